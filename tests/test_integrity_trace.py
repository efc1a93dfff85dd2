"""Routing traces: every malformed field is a TraceError naming it, in memory and on disk."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.traces import Trace, TraceError, synthetic_trace


@pytest.fixture
def trace():
    return synthetic_trace(num_layers=2, num_tokens=16, num_experts=4, top_k=2, intermediate_size=32)


def _fields(t: Trace) -> dict:
    return dict(index=t.index, weights=t.weights, layer_ids=list(t.layer_ids), meta=dict(t.meta),
                seq_starts=list(t.seq_starts))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(seq_starts=[0, 16]), "seq_starts must increase strictly from 0 and stay below the 16 tokens"),
        (dict(seq_starts=[0, 99]), "seq_starts must increase"),
        (dict(seq_starts=[0, 8, 4]), "seq_starts must increase"),
        (dict(seq_starts=[0, 4, 4]), "seq_starts must increase"),
        (dict(seq_starts=[3]), "seq_starts must increase strictly from 0"),
        (dict(seq_starts=[]), "seq_starts must increase"),
        (dict(seq_starts=[0, 4.5]), "seq_starts must be a list of integers"),
        (dict(seq_starts=[0, True]), "seq_starts must be a list of integers"),
        (dict(layer_ids=[0, "1"]), "layer_ids must be a list of integers"),
        (dict(layer_ids=[1, 1]), r"layer_ids \[1, 1\] repeat a layer"),
        (dict(layer_ids=[0]), "1 layer ids for 2 layers"),
        ("index-float", "index must be a numpy array of integers, got float64"),
        ("weights-int", "weights must be a numpy array of floats, got int64"),
        ("weights-nan", "weights hold NaN or infinite"),
        ("index-list", "index must be a numpy array of integers, got list"),
        (dict(meta={"num_experts": 4, "top_k": 2}), "trace metadata lacks 'intermediate_size'"),
        (dict(meta={"num_experts": "4", "top_k": 2, "intermediate_size": 32}), "'num_experts' must be a positive"),
        (dict(meta={"num_experts": 4, "top_k": 3, "intermediate_size": 32}), "2 routed slots per token, metadata "
                                                                              "top_k is 3"),
        (dict(meta={"num_experts": 4, "top_k": 2, "intermediate_size": 0}), "'intermediate_size' must be a positive"),
        (dict(meta=[1]), "trace metadata must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_trace_fields(trace, change, match):
    fields = _fields(trace)
    if change == "index-float":
        fields["index"] = fields["index"].astype(np.float64)
    elif change == "weights-int":
        fields["weights"] = fields["weights"].astype(np.int64)
    elif change == "weights-nan":
        fields["weights"] = fields["weights"].copy()
        fields["weights"][1, 3, 0] = np.nan
    elif change == "index-list":
        fields["index"] = fields["index"].tolist()
    else:
        fields.update(change)
    with pytest.raises(TraceError, match=match):
        Trace(**fields)


def test_good_trace_with_sequences_round_trips(trace, tmp_path):
    t = Trace(**(_fields(trace) | dict(seq_starts=[0, 5, 15])))
    t.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    assert back.seq_starts == [0, 5, 15] and np.array_equal(back.index, t.index)


@pytest.mark.parametrize(
    "name, value, match",
    [("seq_starts", np.array([0.0, 4.0]), "seq_starts must be a 1-D integer array, got float64"),
     ("seq_starts", np.array([0, 40]), "seq_starts must increase strictly"),
     ("layer_ids", np.array([[0, 1]]), "layer_ids must be a 1-D integer array"),
     ("index", None, "index must hold integers and weights floats"),
     ("meta", np.asarray(json.dumps([1, 2])), "not a routing trace")],
)  # fmt: skip
def test_bad_trace_files_name_the_file_and_field(trace, tmp_path, name, value, match):
    path = tmp_path / "t.npz"
    arrays = dict(index=trace.index.astype(np.int16), weights=trace.weights, layer_ids=np.asarray(trace.layer_ids),
                  seq_starts=np.asarray(trace.seq_starts),
                  meta=np.asarray(json.dumps({"format": "crisp-routing-trace", "version": 1, **trace.meta})))
    arrays[name] = trace.index.astype(np.float32) if value is None else value
    np.savez(path, **arrays)
    with pytest.raises(TraceError, match=f"{path}: .*{match}"):
        Trace.load(path)
