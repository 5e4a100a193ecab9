"""testkit/recorded_rehearsal.py: the recorded rehearsal tables the default suite holds the
planner to (tests/data/rehearsals/*.json). That their checks can fail: a recording of another
table, a rehearsal off by more than the bound, a live rehearsal that moved; that their
planner side imports no torch; that every recording says where it came from."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit import recorded_rehearsal as rr
from testkit.rehearsal import check_totals

SOURCE = "tests/test_rehearse_kinds.py"
NAME = "kinds-fast"


def _recording(name: str = NAME) -> dict:
    return json.loads((rr.DATA / f"{name}.json").read_text())


def _table(rec: dict) -> dict:
    return {kind: r["case"] for kind, r in rec["kinds"].items()}


def test_every_recording_has_its_provenance_and_its_source_records():
    names = sorted(p.stem for p in rr.DATA.glob("*.json"))
    assert names, rr.DATA
    for name in names:
        rec = _recording(name)
        assert rec["table"] == name and rec["command"] == rr.regenerate_command(
            rec["source"], name)
        assert rec["torch"] and rec["date"] and rec["commit"] and rec["function"], name
        assert "RECORDED_" in (rr.ROOT / rec["source"]).read_text(), (name, rec["source"])


def test_a_recording_of_another_table_names_the_command(monkeypatch, tmp_path):
    rec = _recording()
    table = _table(rec)
    kind = next(iter(table))
    changed = dict(table, **{kind: dict(table[kind], plan=dict(table[kind]["plan"], zero=2))})
    with pytest.raises(AssertionError, match="recorded another table: run `python -m testkit"):
        rr.recorded_table(SOURCE, NAME, changed)
    monkeypatch.setattr(rr, "DATA", tmp_path)
    with pytest.raises(AssertionError, match="no recording"):
        rr.recorded_table(SOURCE, NAME, table)


def test_a_rehearsal_six_percent_larger_fails_the_5_percent_check(monkeypatch, tmp_path):
    """The planner side is computed, not read: the committed recording passes, the same
    recording with one kind's rehearsed total 6% larger does not."""
    rec = _recording()
    check_totals(rr.recorded_table(SOURCE, NAME, _table(rec)), "rehearsal")
    kind = next(iter(rec["kinds"]))
    rec["kinds"][kind]["rehearsed_gib"]["total"] *= 1.06
    (tmp_path / f"{NAME}.json").write_text(json.dumps(rec))
    monkeypatch.setattr(rr, "DATA", tmp_path)
    with pytest.raises(AssertionError, match=f"beyond 5%.*{kind}"):
        check_totals(rr.recorded_table(SOURCE, NAME, _table(rec)), "rehearsal")


def test_a_live_rehearsal_that_moved_is_named():
    rec = _recording()
    assert rr.same_rehearsal(rec, rec) == []
    live = json.loads(json.dumps(rec))
    kind = next(iter(live["kinds"]))
    live["kinds"][kind]["rehearsed_gib"]["activations"] += 2e-9
    live["kinds"][kind]["rank"] += 1
    diff = rr.same_rehearsal(rec, live)
    assert len(diff) == 2 and all(d.startswith(kind) for d in diff), diff
    values = {"values": {"a": 1, "b": 2}}
    assert rr.same_values(values, {"values": {"a": 1, "b": 3}}) == ["b: 2 recorded, 3 now"]


PRICE_ALL = """
import json, sys
from testkit.no_torch import RefuseTorch
sys.meta_path.insert(0, RefuseTorch())
from testkit import recorded_rehearsal as rr
out = {}
for path in sorted(rr.DATA.glob("*.json")):
    rec = json.loads(path.read_text())
    for kind, r in rec.get("kinds", {}).items():
        out[path.stem + ": " + kind] = rr.priced(r["case"], r["pp_rank"], r["compile"] is not None)
print("RESULT" + json.dumps(out))
"""


def test_the_planner_side_of_every_recording_imports_no_torch():
    """Every recorded case priced in a process that refuses torch: what the default tests
    price in theirs, and within 5% of the rehearsal in the total row (the tables' bound)."""
    out = subprocess.run([sys.executable, "-c", PRICE_ALL], capture_output=True, text=True,
                         cwd=rr.ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    priced = json.loads(out.stdout.split("RESULT", 1)[1])
    assert len(priced) >= 20, sorted(priced)
    for path in sorted(rr.DATA.glob("*.json")):
        for kind, r in json.loads(path.read_text()).get("kinds", {}).items():
            rows = priced[f"{path.stem}: {kind}"]
            assert rows == rr.priced(r["case"], r["pp_rank"], r["compile"] is not None)
            assert rows["total"] / r["rehearsed_gib"]["total"] - 1 == pytest.approx(0, abs=0.05)
