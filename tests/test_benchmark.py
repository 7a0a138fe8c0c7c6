"""scripts/benchmark.py runs every item in --quick mode and writes well-formed JSON (it is never timed here)."""

import json
import sys

from conftest import run_subprocess


def test_quick_benchmark_writes_every_item(tmp_path):
    out = tmp_path / "bench.json"
    result = run_subprocess([sys.executable, "scripts/benchmark.py", "--quick", "--out", out,
                             "--mnist-dir", tmp_path / "absent", "--adult-csv", tmp_path / "absent.csv"], timeout=600)
    assert result.code == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["quick"] is True and "torch" in data["machine"]
    assert sorted(data["items"], key=int) == [str(i) for i in range(1, 10)]
    for number, item in data["items"].items():
        assert {"item", "result", "target", "met", "seconds"} <= item.keys(), number
        assert item["met"] in (True, False, None)
        assert f"| {number} | {item['item']} | {item['result']} |" in result.stdout
    assert data["items"]["3"]["met"] is None and data["items"]["3"]["result"].startswith("skipped")
    assert data["items"]["8"]["met"] is None and data["items"]["8"]["result"].startswith("skipped")
    assert data["items"]["1"]["equal_weights"] is True  # the core's step changes no number
    assert data["items"]["4"]["tokens_per_s"]["fp32 eager"] > 0
