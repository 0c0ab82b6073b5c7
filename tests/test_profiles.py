"""Switch hardware profiles: ``ina-switch serve --profile NAME`` refuses what the device cannot do.

The switch runs as a real ``python -m switch_model serve`` subprocess; clients are real ina.Clients
over UDP/TCP on 127.0.0.1.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import PY, ROOT, SwitchProc, bfp_reference, control, free_port  # noqa: E402

from ina import compression  # noqa: E402
from ina.client import AllreduceError, Client  # noqa: E402
from ina.control import ControlError  # noqa: E402
from ina.profiles import PROFILES, ProfileError, get_profile  # noqa: E402


@pytest.fixture(scope="module")
def tofino(tmp_path_factory):
    sw = SwitchProc("--profile", "tofino", log_path=tmp_path_factory.mktemp("tofino") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


def join(port, job, n=1, **kw):
    return {"op": "join", "job": job, "rank": 0, "world_size": n, "udp_port": 1, "timeout": 2, **kw}


def test_profile_sets_the_devices_limits_and_names_itself(tofino):
    st = tofino.stats()
    assert st["config"]["elements"] == 64 and st["config"]["register_bits"] == 32
    assert st["config"]["slots"] == 8192
    assert st["profile"].startswith("tofino (64 elements/packet, 32-bit registers")
    assert "profile tofino (" in tofino.log()


@pytest.mark.parametrize("msg,error", [
    ({"elements": 128}, "switch profile 'tofino' cannot take 128 elements per packet: at most 64 per packet"),
    ({"world_size": 33}, "switch profile 'tofino' cannot run a job of 33 workers: at most 32 workers per job"),
    ({"elements": 64, "codecs": ["nc"]},
     "switch profile 'tofino' cannot aggregate codec 'nc': re-encoding NC8 sums needs a leading-one search"),
    ({"elements": 64, "codecs": ["3lc"]}, "switch profile 'tofino' cannot aggregate codec '3lc': variable-length"),
])
def test_join_beyond_the_profile_is_refused_naming_profile_and_limit(tofino, msg, error):
    with pytest.raises(ControlError) as ei:
        control(tofino.port, join(tofino.port, 40, **msg), timeout=10)
    assert error in str(ei.value), str(ei.value)
    assert "40" not in tofino.stats()["jobs"]


def test_feasible_codec_runs_and_a_second_job_is_refused(tofino):
    c = Client(("127.0.0.1", tofino.port), rank=0, world_size=1, job=41, elements=64, slots=8, timeout=10,
               codecs=("bfp32",))
    try:
        x = np.linspace(-1, 1, 300, dtype=np.float32)
        ref = bfp_reference([x.copy()])
        c.allreduce(x, "bfp32")
        assert np.array_equal(x, ref)
        with pytest.raises(AllreduceError, match="switch profile 'tofino' cannot install another job "
                                                 r"\(1 running\): at most 1 at a time"):
            Client(("127.0.0.1", tofino.port), rank=0, world_size=1, job=42, elements=64, slots=8, timeout=5)
    finally:
        c.close()
    # raw NC8 sums are within the device's means: the same codec is accepted for a raw job
    c = Client(("127.0.0.1", tofino.port), rank=0, world_size=1, job=43, elements=64, slots=8, timeout=10,
               codecs=("nc",), raw=True)
    c.close()


def test_settings_beyond_the_profile_refused_at_startup():
    r = subprocess.run([PY, "-m", "switch_model", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
                        "--profile", "tofino", "--elements", "1024"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "switch profile 'tofino' cannot take 1024 elements per packet: at most 64 per packet" in r.stderr, r.stderr
    r = subprocess.run([PY, "-m", "switch_model", "serve", "--port", str(free_port()), "--profile", "asic9"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown switch profile 'asic9'; known: software, tofino" in r.stderr, r.stderr


def test_default_profile_keeps_the_software_switch(tmp_path):
    sw = SwitchProc(log_path=tmp_path / "sw.log")
    try:
        st = sw.stats()
        assert st["profile"].startswith("software") and st["config"]["elements"] == 1024
        assert st["config"]["slots"] == 512 and st["config"]["register_bits"] == 64
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("c", Client(("127.0.0.1", sw.port), rank=0, world_size=1,
                                                                        job=7, elements=1024, codecs=("nc", "3lc"))))
        t.start()
        t.join(timeout=30)
        got["c"].close()
    finally:
        assert sw.terminate() == 0


def test_every_codec_states_its_feasibility_under_every_profile():
    for prof in PROFILES.values():
        for name in compression.available():
            ok, why = compression.get(name).feasible_under(prof)
            assert isinstance(ok, bool) and why
    sw, tf = get_profile("software"), get_profile("tofino")
    assert all(compression.get(n).feasible_under(sw)[0] for n in compression.available())
    assert not compression.get("nc").feasible_under(tf)[0] and compression.get("nc").feasible_under(tf, raw=True)[0]
    assert compression.get("bfp32").feasible_under(tf)[0]
    assert not any(compression.get(n).feasible_under(tf)[0] for n in compression.available()
                   if compression.get(n).aggregation == "host")
    with pytest.raises(ProfileError, match="unknown switch profile 'x'"):
        get_profile("x")
