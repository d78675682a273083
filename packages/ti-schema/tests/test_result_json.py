"""RESULT_JSON_SCHEMA and validate_result_json agree, and catch every documented problem."""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from ti_schema import RESULT_JSON_SCHEMA, SchemaMismatchError, validate_result_json
from ti_schema.result_json import AGGREGATE_KEYS, STATISTIC_KEYS, result_json_problems


def statistic(**changes: Any) -> dict[str, Any]:
    stat: dict[str, Any] = {
        "observations": 12,
        "unavailable": 0,
        "mean": 0.25,
        "std": 1.0,
        "min": -3,
        "p25": -0.5,
        "p50": 0.0,
        "p75": 0.75,
        "max": 4.5,
        "previous_window_mean": 0.2,
        "recent_window_mean": 0.3,
        "unavailable_reason": None,
    }
    stat.update(changes)
    return stat


def valid_result() -> list[dict[str, Any]]:
    output = {
        "call_index": 0,
        "signal": "output",
        "tensor_path": "",
        "mode": "train",
        "grad_enabled": True,
        "latest_shape": [32, 10],
        "dtype": "float32",
        "statistics": {
            "mean": statistic(),
            "zero_fraction": statistic(std=0.0),
            "my metric": statistic(
                previous_window_mean=None,
                recent_window_mean=None,
                unavailable_reason="fewer than two windows",
            ),
        },
    }
    gradient = copy.deepcopy(output)
    gradient.update(signal="output_gradient", tensor_path="['logits']")
    gradient["statistics"] = {
        "p50": statistic(
            observations=3,
            unavailable=3,
            **dict.fromkeys(AGGREGATE_KEYS),
            unavailable_reason="empty tensor",
        )
    }
    return [
        {"layer": "encoder.0", "type": "Linear", "aliases": ["shared"], "tensors": [output]},
        {"layer": "head", "type": "Linear", "aliases": [], "tensors": [gradient]},
        {"layer": "", "type": "Net", "aliases": [], "tensors": []},  # selected, never executed
    ]


def _set(path: tuple[Any, ...], value: Any) -> Callable[[Any], None]:
    def mutate(doc: Any) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple[Any, ...]) -> Callable[[Any], None]:
    def mutate(doc: Any) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


STAT = (0, "tensors", 0, "statistics", "mean")
TENSOR = (0, "tensors", 0)

# (mutation, JSON path expected in the error); every one must be refused by both validators.
INVALID: dict[str, tuple[Callable[[Any], None], str]] = {
    "layer missing": (_delete((0, "layer")), "$[0].layer"),
    "layer not a string": (_set((0, "layer"), 3), "$[0].layer"),
    "unknown layer key": (_set((0, "params"), 10), "$[0].params"),
    "aliases not a list": (_set((0, "aliases"), "shared"), "$[0].aliases"),
    "alias not a string": (_set((0, "aliases", 0), None), "$[0].aliases[0]"),
    "tensors missing": (_delete((1, "tensors")), "$[1].tensors"),
    "tensor not an object": (_set(TENSOR, [1]), "$[0].tensors[0]"),
    "negative call_index": (_set((*TENSOR, "call_index"), -1), "$[0].tensors[0].call_index"),
    "fractional call_index": (_set((*TENSOR, "call_index"), 1.5), "$[0].tensors[0].call_index"),
    "unknown signal": (_set((*TENSOR, "signal"), "activations"), "$[0].tensors[0].signal"),
    "unknown mode": (_set((*TENSOR, "mode"), "inference"), "$[0].tensors[0].mode"),
    "grad_enabled not bool": (_set((*TENSOR, "grad_enabled"), 1), "grad_enabled"),
    "shape entry negative": (_set((*TENSOR, "latest_shape", 1), -10), "latest_shape[1]"),
    "shape entry bool": (_set((*TENSOR, "latest_shape", 1), True), "latest_shape[1]"),
    "shape null": (_set((*TENSOR, "latest_shape"), None), "latest_shape"),
    "dtype missing": (_delete((*TENSOR, "dtype")), "$[0].tensors[0].dtype"),
    "unknown tensor key": (_set((*TENSOR, "device"), "cpu"), "$[0].tensors[0].device"),
    "statistics a list": (_set((*TENSOR, "statistics"), []), "$[0].tensors[0].statistics"),
    "empty metric name": (_set((*TENSOR, "statistics", ""), statistic()), "statistics"),
    "statistic missing key": (_delete((*STAT, "p75")), "statistics.mean.p75"),
    "unknown statistic key": (_set((*STAT, "p99"), 1.0), "statistics.mean.p99"),
    "aggregate a string": (_set((*STAT, "std"), "1.0"), "statistics.mean.std"),
    "aggregate a bool": (_set((*STAT, "max"), False), "statistics.mean.max"),
    "negative observations": (_set((*STAT, "observations"), -1), "mean.observations"),
    "null observations": (_set((*STAT, "unavailable"), None), "mean.unavailable"),
    "reason not a string": (_set((*STAT, "unavailable_reason"), 0), "unavailable_reason"),
    "null aggregate without reason": (
        _set((*STAT, "previous_window_mean"), None),
        "statistics.mean.unavailable_reason",
    ),
    "null aggregate reason missing": (
        _set((0, "tensors", 0, "statistics", "my metric", "unavailable_reason"), None),
        "statistics['my metric'].unavailable_reason",
    ),
}


def test_valid_document_conforms() -> None:
    doc = valid_result()
    validate_result_json(doc)
    validate_result_json(json.loads(json.dumps(doc, allow_nan=False)))
    validate_result_json([])


@pytest.mark.parametrize("case", sorted(INVALID))
def test_each_problem_is_reported_with_its_json_path(case: str) -> None:
    mutate, path = INVALID[case]
    doc = valid_result()
    mutate(doc)
    with pytest.raises(SchemaMismatchError) as info:
        validate_result_json(doc)
    assert info.value.subject == "result.json"
    assert info.value.kinds == {"json"}
    assert any(path in m.where for m in info.value.mismatches), str(info.value)


def test_every_problem_is_listed_in_one_error() -> None:
    doc = valid_result()
    for case in ("unknown signal", "negative observations", "dtype missing"):
        INVALID[case][0](doc)
    with pytest.raises(SchemaMismatchError, match="3 problems"):
        validate_result_json(doc)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_not_strict_json(bad: float) -> None:
    doc = valid_result()
    doc[0]["tensors"][0]["statistics"]["mean"]["mean"] = bad
    problems = result_json_problems(doc)
    assert [m.where for m in problems] == ["$[0].tensors[0].statistics.mean.mean"]
    assert "strict JSON has no NaN or Infinity" in problems[0].message


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"layer": "x"}, "expected an array, got object"),
        ('[{"layer": "x"}]', "pass json.loads(text)"),
        ([{1: "x"}], "non-string key 1"),
        ([{"layer": object()}], "is not a JSON value"),
    ],
)
def test_wrong_top_level_and_non_json_values(data: Any, needle: str) -> None:
    with pytest.raises(SchemaMismatchError, match=re.escape(needle)):
        validate_result_json(data)


def test_schema_lists_every_statistic_key() -> None:
    statistic_schema = RESULT_JSON_SCHEMA["$defs"]["statistic"]
    assert statistic_schema["required"] == list(STATISTIC_KEYS)
    assert set(statistic_schema["properties"]) == set(STATISTIC_KEYS)
    json.dumps(RESULT_JSON_SCHEMA, allow_nan=False)


def test_json_schema_agrees_with_the_python_validator() -> None:
    validator_class = jsonschema.Draft202012Validator
    validator_class.check_schema(RESULT_JSON_SCHEMA)
    validator = validator_class(RESULT_JSON_SCHEMA)
    assert list(validator.iter_errors(valid_result())) == []
    for case, (mutate, _path) in sorted(INVALID.items()):
        doc = valid_result()
        mutate(doc)
        assert list(validator.iter_errors(doc)), f"JSON Schema accepts {case!r}"
