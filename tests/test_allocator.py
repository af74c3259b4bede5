"""Which commands ask polars' jemalloc to hand freed pages back at once (only `draco run`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys
sys.argv = ["draco", *sys.argv[1:]]
from draco_cli.cli import main
try:
    main()
except SystemExit:
    pass
print(os.environ.get("_RJEM_MALLOC_CONF"), file=sys.stderr)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tuning is Linux only")
@pytest.mark.parametrize(("command", "expected"), [
    ("run", "dirty_decay_ms:0,muzzy_decay_ms:0"), ("credit", "None"), ("report", "None")])
def test_only_run_releases_polars_pages(command, expected):
    env = {k: v for k, v in os.environ.items() if k != "_RJEM_MALLOC_CONF"}
    res = subprocess.run([sys.executable, "-c", PROBE, command, "--help"], env=env,
                         capture_output=True, text=True)
    assert res.stderr.strip().splitlines()[-1] == expected


def test_a_users_setting_wins():
    env = dict(os.environ, _RJEM_MALLOC_CONF="dirty_decay_ms:500")
    res = subprocess.run([sys.executable, "-c", PROBE, "run", "--help"], env=env,
                         capture_output=True, text=True)
    assert res.stderr.strip().splitlines()[-1] == "dirty_decay_ms:500"
