"""`nereus demo`: four live transitions on 4 processes, every element checked."""

import json

import pytest
from typer.testing import CliRunner

from nereus.cli.app import app


@pytest.mark.timeout(300)
def test_demo_reshards_every_transition_exactly():
    result = CliRunner().invoke(app, ["demo", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output[result.output.index("[") :])
    assert [r["transition"].split(":")[0].split(" ")[0] for r in rows] == ["weight", "TP2·DP2", "TP2·PP2", "rank"]
    assert all(r["exact"] for r in rows)
    assert rows[1]["bytes_crossing"] == 0  # TP2·DP2 -> TP2·PP2: every target shard is already in place
    assert rows[3]["bytes_staged"] > 0  # the lost rank's shards come from the staged checkpoint
