from __future__ import annotations

import io
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.ingest.jsonstream import JsonStream, iter_object_with_array
from tests.conftest import TAU, TAU2, examples

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(json_values, max_size=8), st.integers(1, 64), st.sampled_from(["", " ", "\n  "]))
def test_array_stream_equals_json_load(items, chunk, ws):
    text = ws + "[" + ws + ("," + ws).join(json.dumps(x) for x in items) + ws + "]" + ws
    stream = JsonStream(io.StringIO(text), "mem", chunk=chunk)
    got = [v for _, v in stream.array_items(str)]
    stream.end()
    assert got == items


def test_real_files_stream_in_small_chunks():
    expected = json.loads(TAU.read_text())
    stream = JsonStream(io.StringIO(TAU.read_text()), "tau", chunk=997)
    assert [v for _, v in stream.array_items(str)] == expected

    doc = json.loads(TAU2.read_text())
    seen = {}
    sims = []
    for key, value in iter_object_with_array(io.StringIO(TAU2.read_text()), "t2", "simulations", str):
        if key == "simulations":
            sims.append(value[1])
        else:
            seen[key] = value
    assert sims == doc["simulations"]
    assert seen == {k: v for k, v in doc.items() if k != "simulations"}
