"""The testbed's logic that needs no GPU, checked on any machine with python3 (and gcc, make and
bash for the C programs and the MPS cases): tables, ratios, spreads and verdicts; the
calibration window; the step plan and its groups; the re-create step's verdicts; the ranks'
environments; the ledger against the stats; the C programs as make builds them, run against a
stand-in NCCL; CUDA MPS start, stop and restart (against a stand-in nvidia-cuda-mps-control and
a stand-in libcuda.so.1); a pair killed at its limit; every step and the report from canned
records; run_all.sh's MPS handling and groups.

    python3 tests/gpu/test_logic.py [-v]
"""
import contextlib
import csv
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import arcases  # noqa: E402
import calibrate  # noqa: E402
import common  # noqa: E402
import compare_builds  # noqa: E402
import integrity  # noqa: E402
import launch  # noqa: E402
import measure  # noqa: E402
import mps  # noqa: E402
import plans  # noqa: E402
import report  # noqa: E402
import steps  # noqa: E402


def setUpModule():
    """Where this checkout's plugin/config.go holds no all-reduce window yet, the steps' logic is
    checked against a stand-in default: the gather's window of the same fabric (a config file
    given by path is still read)."""
    try:
        common.default_allreduce_window(launch.INTERCEPT_FABRIC)
    except ValueError:
        real = common.default_allreduce_window
        p = mock.patch.object(common, "default_allreduce_window",
                              lambda fabric, path=None: real(fabric, path) if path else common.default_window(fabric))
        p.start()
        unittest.addModuleCleanup(p.stop)


def read(path):
    with open(path) as f:
        return f.read()


def S(*xs):
    return measure.summarize(xs)


# ---- measure --------------------------------------------------------------------------------

class MeasureTest(unittest.TestCase):
    def test_summarize(self):
        s = S(3, 1, 2, 10)
        self.assertEqual((s["n"], s["median"], s["min"], s["max"]), (4, 2.5, 1.0, 10.0))
        self.assertAlmostEqual(s["spread_pct"], 360.0)
        self.assertIsNone(measure.summarize([]))
        self.assertIsNone(measure.summarize(None))

    def test_compare_and_ratio(self):
        a, b = S(10, 11, 12), S(5, 6, 7)
        self.assertEqual(measure.compare(a, b), "slower")
        self.assertEqual(measure.compare(b, a), "faster")
        self.assertEqual(measure.compare(S(10, 11), S(10.5, 20)), "within")
        self.assertEqual(measure.compare(S(10), S(10)), "within")  # equal: not beyond the spread
        self.assertIsNone(measure.compare(a, None))
        r = measure.ratio(a, b)
        self.assertAlmostEqual(r["median"], 11 / 6)
        self.assertAlmostEqual(r["low"], 10 / 7)
        self.assertAlmostEqual(r["high"], 12 / 5)
        self.assertEqual(measure.fmt_ratio(r), "1.83 (1.43-2.40)")
        self.assertEqual(measure.fmt_range(S(1, 2, 3)), "2.0 (1.0-3.0)")

    def test_round_orders(self):
        o = measure.round_orders(["a", "b", "c"], 3)
        self.assertEqual(o, [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]])
        for c in "abc":  # every position once
            self.assertEqual(sorted(r.index(c) for r in o), [0, 1, 2])

    def test_replays_for(self):
        self.assertEqual(measure.replays_for(25, 4, 10, 10, 250), 100)
        self.assertEqual(measure.replays_for(2500, 4, 10, 10, 250), 10)
        self.assertEqual(measure.replays_for(0.1, 4, 10, 10, 250), 250)
        self.assertEqual(measure.replays_for(None, 4, 10, 10, 250), 250)

    def test_size_label(self):
        self.assertEqual([measure.size_label(b) for b in (16, 4096, 1 << 20, 524304)],
                         ["16 B", "4 KiB", "1 MiB", "524304 B"])

    def test_pooled_and_spread(self):
        runs = [("intercept", {"graph": {"16": [30, 31]}}), ("intercept", {"graph": {"16": [32]}}),
                ("sock", {"graph": {"16": [20, 21, 22]}, "eager": {"16": [50]}})]
        t = measure.pooled(runs, "graph")
        self.assertEqual(t, {"intercept": {16: [30, 31, 32]}, "sock": {16: [20, 21, 22]}})
        self.assertEqual(measure.pooled(runs, "eager"), {"sock": {16: [50]}})
        self.assertAlmostEqual(measure.worst_spread(t, ["intercept"], [16])["intercept"], 100 * 2 / 31)
        self.assertEqual(measure.worst_spread(t, ["sock", "none"], [16, 64]), {"sock": 100 * 2 / 21, "none": None})

    def test_latency_csv_roundtrip(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "l.csv")
            measure.write_csv(p, ["config", "mode", "bytes_per_rank", "round", "rep", "us_per_gather"],
                              [["a", "graph", 16, 0, 0, "1.0"], ["a", "graph", 16, 1, 0, "3.0"], ["a", "eager", 16, 0, 0, "9"]])
            t = measure.read_latency_csv(p)
            self.assertEqual(t["graph"]["a"][16]["median"], 2.0)
            self.assertEqual(t["eager"]["a"][16]["n"], 1)


class WindowTest(unittest.TestCase):
    SIZES = [16, 256, 4096, 16384, 65536, 262144, 1048576]

    def make(self, path, ref):
        return ({b: S(*x) for b, x in zip(self.SIZES, path)}, {b: S(*x) for b, x in zip(self.SIZES, ref)})

    def test_contiguous_window(self):
        o, r = self.make([(50, 51), (50, 52), (40, 41), (42, 43), (60, 61), (200, 210), (500, 510)],
                         [(30, 31), (35, 36), (45, 46), (50, 51), (70, 72), (150, 160), (400, 420)])
        w = measure.window(self.SIZES, o, r)
        self.assertEqual((w["floor"], w["cap"]), (4096, 65536))
        self.assertEqual(measure.window_env(w), "export ROCE_GATHER_MIN_BYTES=4096 ROCE_GATHER_MAX_BYTES=65536")
        self.assertEqual(w["notes"], [])

    def test_noise_inside_kept_at_edges_trimmed(self):
        # 16 KiB: one-shot leads on the median but the ranges overlap (noise): kept inside the
        # window; 256 B leads only within the spread at the low edge: trimmed.
        o, r = self.make([(50, 51), (34, 35.5), (40, 41), (44, 52), (60, 61), (200, 210), (500, 510)],
                         [(30, 31), (35, 36), (45, 46), (48, 51), (70, 72), (150, 160), (400, 420)])
        w = measure.window(self.SIZES, o, r)
        self.assertTrue(w["per_size"][1]["lead"] and not w["per_size"][1]["win"])
        self.assertTrue(w["per_size"][3]["lead"] and not w["per_size"][3]["win"])
        self.assertEqual((w["floor"], w["cap"]), (4096, 65536))

    def test_break_and_longest_run(self):
        # Two runs: 256 B alone, and 16 KiB..256 KiB: the longer wins; the other is noted.
        o, r = self.make([(50, 51), (20, 21), (60, 61), (40, 41), (50, 51), (100, 101), (500, 510)],
                         [(30, 31), (35, 36), (45, 46), (50, 51), (70, 72), (150, 160), (400, 420)])
        w = measure.window(self.SIZES, o, r)
        self.assertEqual((w["floor"], w["cap"]), (16384, 262144))
        self.assertEqual(w["runs"], [(256, 256), (16384, 262144)])
        self.assertTrue(any("also wins from 256 B to 256 B" in n for n in w["notes"]))

    def test_tie_goes_to_larger_saving(self):
        o, r = self.make([(10, 11), (10, 11), (60, 61), (10, 11), (10, 11), (300, 301), (500, 510)],
                         [(20, 21), (20, 21), (45, 46), (50, 51), (50, 51), (150, 160), (400, 420)])
        w = measure.window(self.SIZES, o, r)
        self.assertEqual((w["floor"], w["cap"]), (16384, 65536))

    def test_never_wins(self):
        o, r = self.make([(50, 51)] * 7, [(30, 31)] * 7)
        w = measure.window(self.SIZES, o, r)
        self.assertIsNone(w["floor"])
        self.assertEqual(measure.window_env(w), "export ROCE_GATHER_ENABLE=0")
        # Leads on every median, but never beyond the spread: still off.
        o, r = self.make([(30, 40)] * 7, [(31, 41)] * 7)
        self.assertIsNone(measure.window(self.SIZES, o, r)["floor"])

    def test_edges_noted_and_gaps_break(self):
        o, r = self.make([(10, 11)] * 7, [(20, 21)] * 7)
        w = measure.window(self.SIZES, o, r)
        self.assertEqual((w["floor"], w["cap"]), (16, 1048576))
        self.assertEqual(len(w["notes"]), 2)  # the cap and the floor may lie beyond what was measured
        del o[4096]  # a size measured on one path only breaks the run
        w = measure.window(self.SIZES, o, r)
        self.assertEqual((w["floor"], w["cap"]), (16384, 1048576))


# ---- the plan, the re-create verdicts and the configs ----------------------------------------

class StepPlanTest(unittest.TestCase):
    def test_every_step_has_its_function_and_groups(self):
        names = [n for n, _, _ in steps.PLAN]
        self.assertEqual(len(names), len(set(names)))
        self.assertEqual(sorted(names), sorted(n[len("step_"):] for n in dir(steps) if n.startswith("step_")))
        for n, limit, groups in steps.PLAN:
            self.assertGreater(limit, 0, n)
            self.assertTrue(groups, n)

    def test_groups_and_order(self):
        self.assertEqual([n for n, _ in steps.plan(["check"])],
                         ["env", "gather", "graphs", "capi", "jax", "pynccl", "abort", "integrity", "recreate", "allreduce",
                          "latency", "plot"])
        # The all-reduce's speed, the decode step and the calibration first; latency fits into what is left.
        self.assertEqual([n for n, _ in steps.plan(["timing"])], ["env", "arlatency", "decode", "calibrate", "latency",
                                                                  "plot"])
        # Each once, in the plan's order, whatever the order asked.
        self.assertEqual(steps.plan(["plot", "gather", "timing", "gather"]),
                         [("env", 45), ("gather", 200), ("arlatency", 120), ("decode", 130), ("calibrate", 120),
                          ("latency", 250), ("plot", 30)])
        # timing's limits but latency's leave it 30 s of the default budget at the least: it takes what is left.
        self.assertLessEqual(sum(limit for n, limit in steps.plan(["timing"]) if n != "latency"), 480 - 30)
        self.assertEqual(steps.plan([]), [])
        with self.assertRaisesRegex(ValueError, "names 'sweep', 'intercept': neither a step .* nor a group "
                                                r"\(check, timing\)"):
            steps.plan(["gather", "sweep", "intercept"])

    def test_plan_command(self):
        p = subprocess.run([sys.executable, os.path.join(HERE, "steps.py"), "plan"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.split("\n")[0], "env 45")
        self.assertEqual(len(p.stdout.split()), 2 * len(steps.plan([steps.DEFAULT_GROUP])))
        p = subprocess.run([sys.executable, os.path.join(HERE, "steps.py"), "plan", "kernels"], capture_output=True,
                           text=True)
        self.assertEqual(p.returncode, 1)
        self.assertIn("names 'kernels': neither a step", p.stderr)


def recreate_rec(firsts=("ok", "ok"), seconds=("ok", "ok"), stats=None, failures=(), timed_out=False, values=()):
    """A re-create pair's record: each rank's group outcomes and ledgers (RECREATE_SIZES and one
    above a cap of 256 KiB), and stats as given (default: every in-window gather of both groups
    intercepted)."""
    above = 262144 + 16
    results, ledgers = [], {}
    for key in ("first", "second"):
        L = common.Ledger()
        for b in plans.RECREATE_SIZES[key] + [above]:
            L.gather(b, comm=key)
        ledgers[key] = L.n
    for r in (0, 1):
        n = {"first": firsts[r], "second": seconds[r], "ledgers": ledgers}
        if seconds[r] == "error":
            n["second_error"] = "DistBackendError: NCCL error in: ncclCommInitRankConfig"
        results.append({"failures": list(values), "numbers": n})
    if stats is None:
        e = common.intercept_expectation(common.merged(*ledgers.values())["calls"], (0, 262144), True)
        stats = istats(e["launches"], e["gathers"], e["launch_bytes"], e["bytes"], forwarded=2, way_in="hooked")
    return {"timed_out": timed_out, "limit": 60, "failures": list(failures), "results": results, "stats": [stats, stats],
            "ledgers": ledgers}


class RecreatePlanTest(unittest.TestCase):
    W = (0, 262144)

    def test_cases(self):
        self.assertEqual([c for c, *_ in plans.recreate_cases("")], ["intercept", "intercept-refcount1", "nccl-socket"])
        cases = plans.recreate_cases("/n/libnccl.so.2")
        self.assertEqual([(c, cfg, env.get(plans.REF_COUNT), lib) for c, cfg, env, lib in cases],
                         [("intercept", "intercept", None, ""), ("intercept-refcount1", "intercept", "1", ""),
                          ("nccl-lib", "intercept", None, "/n/libnccl.so.2"),
                          ("nccl-lib-refcount1", "intercept", "1", "/n/libnccl.so.2"),
                          ("nccl-socket", "nccl-socket", None, "")])

    def test_observed(self):
        o = plans.recreate_observed
        self.assertEqual(o(recreate_rec(), self.W, "hooked"),
                         ("ok", "both process groups byte-exact, every in-window gather intercepted"))
        self.assertEqual(o(recreate_rec(stats=None), None, None)[0], "ok")  # NCCL's transport: no stats to read
        st, text = o(recreate_rec(seconds=("ok", "error")), self.W, "hooked")
        self.assertEqual(st, "second failed")
        self.assertIn("ncclCommInitRankConfig", text)
        self.assertEqual(o(recreate_rec(firsts=("error", "ok")), self.W, "hooked")[0], "error")
        self.assertEqual(o(recreate_rec(values=["recreate/second/32B: 1 of 64 bytes differ"]), self.W, "hooked"),
                         ("error", "wrong values: recreate/second/32B: 1 of 64 bytes differ"))
        self.assertEqual(o(recreate_rec(timed_out=True), self.W, "hooked"), ("error", "still running after 60s: killed"))
        self.assertEqual(o(recreate_rec(failures=["r rank 0: NCCL 2.28.9 ran, not 2.30.7 from LD_PRELOAD=/x"]), self.W,
                           "hooked")[0], "error")
        rec = recreate_rec()
        rec["results"][1] = None
        self.assertEqual(o(rec, self.W, "hooked"), ("error", "a rank wrote no result"))

    def test_path_names_the_group_that_took_it(self):
        L = recreate_rec()["ledgers"]
        one = {k: common.intercept_expectation(L[k]["calls"], self.W, True) for k in L}
        first = istats(one["first"]["launches"], one["first"]["gathers"], one["first"]["launch_bytes"],
                       one["first"]["bytes"], forwarded=5, way_in="hooked")
        st, text = plans.recreate_observed(recreate_rec(stats=first), self.W, "hooked")
        self.assertEqual((st, text), ("off the path", "rank 0: only the first process group's gathers took the path "
                                                      "(the second's went to NCCL)"))
        second = istats(one["second"]["launches"], one["second"]["gathers"], one["second"]["launch_bytes"],
                        one["second"]["bytes"], forwarded=1, way_in="hooked")
        self.assertIn("only the second process group's gathers took the path; the first's are not in the stats",
                      plans.recreate_observed(recreate_rec(stats=second), self.W, "hooked")[1])
        none = istats(0, 0, 0, 0, forwarded=8, way_in="hooked")
        st, text = plans.recreate_observed(recreate_rec(stats=none), self.W, "hooked")
        self.assertEqual(st, "off the path")
        self.assertIn("intercepted.launches=0 gathers=0; expected launches=6 gathers=6", text)

    def test_needs_ref_count(self):
        n = plans.recreate_needs_ref_count
        self.assertEqual(n("ok", "ok"), "not needed")
        self.assertEqual(n("ok", None), "not needed")
        self.assertEqual(n("second failed", "ok"), "needed")
        self.assertEqual(n("off the path", "ok"), "needed")
        self.assertEqual(n("off the path", "off the path"), "unknown")
        self.assertEqual(n("error", "ok"), "unknown")


class LaunchEnvTest(unittest.TestCase):
    def test_rank_env(self):
        outer = {"NCCL_PROTO": "LL", "NCCL_MAX_NCHANNELS": "9", "ROCE_GATHER_MODE": "eager", "NCCL_NVLS_ENABLE": "1",
                 "CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_LOG_DIRECTORY": "/l", "LD_PRELOAD": "/x.so",
                 "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1", "NCCL_NET": "roce_gather", "PATH": "/bin"}
        with mock.patch.dict(os.environ, outer, clear=True):
            e = launch.rank_env("intercept-nonap", 1, "/s.json", {"NCCL_DEBUG": "INFO"}, "/n/libnccl.so.2")
            for k in ("NCCL_PROTO", "NCCL_MAX_NCHANNELS", "ROCE_GATHER_MODE", "NCCL_NET",
                      "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"):
                self.assertNotIn(k, e)  # nothing from outside changes what a config means
            self.assertEqual(e["ROCE_GATHER_PROXY_IDLE_MS"], "0")
            self.assertEqual(e["ROCE_GATHER_STATS"], "/s.json")
            self.assertEqual(e["NCCL_HOSTID"], "testhost-1")
            self.assertEqual(e["NCCL_DEBUG"], "INFO")
            self.assertEqual((e["NCCL_NVLS_ENABLE"], e["TORCH_SYMM_MEM_DISABLE_MULTICAST"], e["NVSHMEM_DISABLE_NVLS"],
                              e["NCCL_MNNVL_ENABLE"]), ("0", "1", "1", "0"))
            self.assertEqual((e["CUDA_MPS_PIPE_DIRECTORY"], e["CUDA_MPS_LOG_DIRECTORY"]), ("/p", "/l"))
            self.assertEqual(e["LD_PRELOAD"], "/n/libnccl.so.2:/x.so")
            e = launch.rank_env("nccl-socket", 0, "/s.json", {"NCCL_NVLS_ENABLE": "1"}, "")
            self.assertEqual(e["LD_PRELOAD"], "/x.so")
            self.assertNotIn("ROCE_GATHER_STATS", e)
            self.assertNotIn("ROCE_GATHER_TRACE", e)
            self.assertEqual(e["NCCL_NET_PLUGIN"], "none")
            self.assertEqual(e["NCCL_NVLS_ENABLE"], "0")  # multicast stays off whatever a step asks

    def test_lib_version(self):
        with tempfile.TemporaryDirectory() as d:
            real = os.path.join(d, "libnccl.so.2.30.7")
            open(real, "w").close()
            os.symlink(real, os.path.join(d, "libnccl.so.2"))
            self.assertEqual(launch.lib_version(os.path.join(d, "libnccl.so.2")), "2.30.7")
            self.assertIsNone(launch.lib_version(os.path.join(d, "nothing")))
        with mock.patch.dict(os.environ, {"ROCE_GATHER_GPU_NCCL_LIB": "x/lib/libnccl.so.2"}):
            self.assertEqual(launch.nccl_lib_default(), os.path.join(launch.REPO, "x/lib/libnccl.so.2"))
        with mock.patch.dict(os.environ, {"ROCE_GATHER_GPU_NCCL_LIB": ""}):
            self.assertEqual(launch.nccl_lib_default(), "")


class InterceptConfigTest(unittest.TestCase):
    """The configs: what each puts in the ranks' environment, and the window their ledgers are
    judged by, read from plugin/config.go."""

    def test_configs(self):
        lib = launch.LIB
        self.assertEqual(sorted(launch.CONFIGS), ["intercept", "intercept-env", "intercept-nonap", "intercept-preload",
                                                  "intercept-wide", "nccl-socket"])
        self.assertEqual(launch.CONFIGS["intercept"], {"NCCL_NET_PLUGIN": lib})  # NCCL_NET_PLUGIN alone
        self.assertEqual(launch.CONFIGS["intercept-preload"], {"LD_PRELOAD": lib})
        # What `python -m roce_gather env` prints for this library: the package's own answer.
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))
        try:
            import roce_gather
            self.assertEqual(launch.CONFIGS["intercept-env"], roce_gather._job_env({}, lib, {}))
        finally:
            sys.path.pop(0)
        self.assertEqual(launch.CONFIGS["intercept-nonap"], {"NCCL_NET_PLUGIN": lib, "ROCE_GATHER_PROXY_IDLE_MS": "0"})
        for c in ("intercept", "intercept-env", "intercept-preload", "intercept-nonap", "intercept-wide"):
            self.assertTrue(launch.uses_plugin(c), c)
        self.assertEqual((launch.way_in("intercept"), launch.way_in("intercept-preload")), ("hooked", "hooked"))
        self.assertFalse(launch.uses_plugin("nccl-socket"))
        self.assertIsNone(launch.intercept_window("nccl-socket"))
        for c in launch.CONFIGS:  # never multicast, and never a variable the library no longer reads
            self.assertNotIn("NCCL_NVLS_ENABLE", launch.CONFIGS[c])
            for k in ("ROCE_GATHER_NET", "ROCE_GATHER_MODE", "ROCE_GATHER_PLACEMENT", "ROCE_GATHER_TCP_CUDA",
                      "ROCE_GATHER_ONESHOT_CHANNELS", "ROCE_GATHER_ONESHOT_CHUNK", "ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH",
                      "NCCL_NET", "NCCL_COLLNET_ENABLE"):
                self.assertNotIn(k, launch.CONFIGS[c], c)

    def test_window_from_config_go(self):
        tcp = common.default_window("tcp")
        self.assertEqual(launch.intercept_window("intercept"), tcp)
        self.assertEqual(launch.intercept_window("intercept-preload"), tcp)
        self.assertEqual(launch.intercept_window("intercept-wide"), (tcp[0], launch.WIDE_CAP))
        with tempfile.TemporaryDirectory() as d:
            go = os.path.join(d, "config.go")
            with open(go, "w") as f:
                f.write("package plugin\n\nconst (\n\tMaxMaxBytes = 64 << 20\n\tSmall = 4 * 1024 // four KiB\n)\n\n"
                        "var OtherWindows = map[string]FabricWindow{\n\t\"tcp\": {MinBytes: 7, MaxBytes: 9},\n}\n\n"
                        "var DefaultWindows = map[string]FabricWindow{\n"
                        "\t\"verbs\": {MinBytes: Small, MaxBytes: 512 << 10}, // measured\n"
                        "\t\"tcp\":   {Off: true, MinBytes: 0, MaxBytes: 1 << 20},\n"
                        "\t\"odd\":   {MaxBytes: MaxMaxBytes / 2},\n}\n")
            self.assertEqual(common.default_window("verbs", go), (4096, 524288))
            self.assertIsNone(common.default_window("tcp", go))  # off by the fabric's default
            with self.assertRaisesRegex(ValueError, "no 'ib' entry"):
                common.default_window("ib", go)
            with self.assertRaisesRegex(ValueError, "MaxMaxBytes / 2"):
                common.default_window("odd", go)
            with open(go, "w") as f:
                f.write("package plugin\n")
            with self.assertRaisesRegex(ValueError, "no `var DefaultWindows"):
                common.default_window("tcp", go)

    def test_window_rules(self):
        cfgs = {"a": {"NCCL_NET_PLUGIN": launch.LIB, "ROCE_GATHER_MIN_BYTES": "100"},
                "b": {"NCCL_NET_PLUGIN": launch.LIB, "ROCE_GATHER_MIN_BYTES": "100", "ROCE_GATHER_MAX_BYTES": "50"},
                "c": {"NCCL_NET_PLUGIN": launch.LIB, "ROCE_GATHER_ENABLE": "0"},
                "d": {"NCCL_NET_PLUGIN": launch.LIB, "ROCE_GATHER_MAX_BYTES": "4096"}}
        with mock.patch.dict(launch.CONFIGS, cfgs), \
                mock.patch.object(common, "default_window", return_value=(16, 65536)) as dw:
            self.assertEqual(launch.intercept_window("a"), (100, 65536))
            self.assertIsNone(launch.intercept_window("b"))  # floor above cap: an empty window, the path off
            self.assertIsNone(launch.intercept_window("c"))
            self.assertEqual(launch.intercept_window("d"), (16, 4096))
            dw.assert_called_with(launch.INTERCEPT_FABRIC)
        with mock.patch.dict(launch.CONFIGS, cfgs), mock.patch.object(common, "default_window", return_value=None):
            self.assertIsNone(launch.intercept_window("a"))  # off by the fabric's default, no cap given
            self.assertEqual(launch.intercept_window("d"), (0, 4096))

    def test_rank_env(self):
        outer = {"LD_PRELOAD": "/x.so", "NCCL_NET_PLUGIN": "/outer.so", "ROCE_GATHER_NET": "1", "NCCL_NET": "IB",
                 "NCCL_COLLNET_ENABLE": "1", "PATH": "/bin"}
        with mock.patch.dict(os.environ, outer, clear=True):
            e = launch.rank_env("intercept", 0, "/s.json")
            mine = {k: v for k, v in e.items() if k.startswith("ROCE_GATHER_") or k in ("NCCL_NET_PLUGIN", "NCCL_NET",
                                                                                      "NCCL_COLLNET_ENABLE")}
            self.assertEqual(mine, {"NCCL_NET_PLUGIN": launch.LIB, "ROCE_GATHER_STATS": "/s.json",
                                    "ROCE_GATHER_TRACE": "/s.json.trace", "ROCE_GATHER_TRACE_EVERY": "4",
                                    "ROCE_GATHER_TRACE_RECORDS": "8192"})
            self.assertEqual(e["LD_PRELOAD"], "/x.so")
            # LD_PRELOAD alone: the library first, then the NCCL asked for, then what was there.
            e = launch.rank_env("intercept-preload", 1, "/s.json", None, "/n/libnccl.so.2")
            self.assertEqual(e["LD_PRELOAD"], f"{launch.LIB}:/n/libnccl.so.2:/x.so")
            self.assertNotIn("NCCL_NET_PLUGIN", e)
            self.assertEqual(e["ROCE_GATHER_STATS"], "/s.json")
            e = launch.rank_env("intercept-nonap", 0, "/s.json")
            self.assertEqual(e["ROCE_GATHER_PROXY_IDLE_MS"], "0")
        with mock.patch.dict(os.environ, {"PATH": "/bin"}, clear=True):
            self.assertNotIn("LD_PRELOAD", launch.rank_env("intercept", 0, "/s.json"))
            self.assertEqual(launch.rank_env("intercept-preload", 0, "/s.json")["LD_PRELOAD"], launch.LIB)


def calls_of(*events):
    """A ledger from (bytes, enq, execs, listform, comm) events, in order."""
    L = common.Ledger()
    for b, enq, execs, listform, comm in events:
        L.gather(b, enq=enq, execs=execs, listform=listform, comm=comm)
    return L.n


def istats(launches, gathers, launch_bytes=None, bytes_=None, forwarded=0, errors=0, way_in=None, **extra):
    st = {"intercepted": {"launches": launches, "launch_bytes": launch_bytes, "forwarded": forwarded,
                          "forwarded_bytes": None, "gathers": gathers, "bytes": bytes_, "errors": errors,
                          "proxy_naps": 0, "proxy_woke_to_work": 0}}
    st["intercepted"] = {k: v for k, v in st["intercepted"].items() if v is not None}
    st["intercepted"].update(extra)
    if way_in:
        st["interceptor"] = {"way_in": way_in, "ncclAllGather": launches + forwarded}
    return st


class InterceptLedgerTest(unittest.TestCase):
    W = (0, 1 << 20)
    BIG = 2 << 20

    def test_agreement_capture_and_replays(self):
        L = calls_of((4096, 1, 0, False, "default"),   # captured before the agreement: NCCL's
                     (4096, 0, 3, False, "default"),   # and so are its replays
                     (16, 1, 1, False, "default"),     # the first eager call: the agreement
                     (16, 4, 0, False, "default"),     # captured after it
                     (16, 0, 40, False, "default"),
                     (self.BIG, 2, 2, False, "default"),
                     (16, 1, 1, False, "group2"),      # another communicator agrees on its own
                     (16, 2, 2, True, "group2"))
        c = L["calls"]
        self.assertEqual(c["4096"], dict(first=0, eager=0, captured=0, list=0, replays=0, pre=1, replays_pre=3))
        self.assertEqual(c["16"], dict(first=2, eager=2, captured=4, list=2, replays=40, pre=0, replays_pre=0))
        self.assertEqual(c[str(self.BIG)]["eager"], 2)
        e = common.intercept_expectation(c, self.W, True)
        self.assertEqual((e["launches"], e["gathers"]), (2 + 4 + 2, 2 + 40 + 2))
        self.assertEqual((e["launch_bytes"], e["bytes"]), (16 * 8, 16 * 44))
        self.assertEqual(e["forwarded_min"], 1 + 2)  # the capture before the agreement, the two above the window
        self.assertEqual(e["forwarded_bytes_min"], 4096 + 2 * self.BIG)
        e0 = common.intercept_expectation(c, self.W, False)
        self.assertEqual((e0["launches"], e0["gathers"]), (6, 42))
        off = common.intercept_expectation(c, None, True)  # the path off: every call is NCCL's
        self.assertEqual((off["launches"], off["gathers"], off["forwarded_min"]), (0, 0, 1 + 8 + 2))

    def test_merged(self):
        a = calls_of((16, 1, 1, False, "first"), (4096, 2, 2, False, "first"))
        b = calls_of((16, 1, 1, False, "second"), (32, 3, 0, False, "second"))
        m = common.merged(a, b)["calls"]
        self.assertEqual(m["16"], dict(first=2, eager=2, captured=0, list=0, replays=0, pre=0, replays_pre=0))
        self.assertEqual((m["4096"]["eager"], m["32"]["captured"]), (2, 3))
        self.assertEqual(a["calls"]["16"]["first"], 1)  # the inputs stay as they were

    def test_grouped_calls_agree_at_the_first_groups_end(self):
        L = common.Ledger()
        L.gather(16, grouped=True)    # the first call, inside a group: NCCL's; the agreement at its end
        L.gather(16, grouped=True)
        L.gather(4096, grouped=True)
        L.gather(self.BIG, grouped=True)
        c = L.n["calls"]
        self.assertEqual(c["16"], dict(first=0, eager=1, captured=0, list=0, replays=0, pre=1, replays_pre=0))
        e = common.intercept_expectation(c, self.W, True)
        self.assertEqual((e["launches"], e["gathers"], e["first_in"]), (2, 2, 0))
        self.assertEqual(e["forwarded_min"], 2)  # the first call and the one above the window
        F, _ = common.intercept_check(istats(2, 2, 16 + 4096, 16 + 4096, forwarded=2, way_in="hooked"), L.n, self.W,
                                      "hooked")
        self.assertEqual(F, [])
        F, _ = common.intercept_check(istats(3, 3, 32 + 4096, 32 + 4096, forwarded=1), L.n, self.W)
        self.assertTrue(any("launches=3" in f for f in F), F)

    def test_refused(self):
        L = common.Ledger()
        with self.assertRaisesRegex(ValueError, "list-form gather made 'default'.s first call"):
            L.gather(16, listform=True)
        with self.assertRaisesRegex(ValueError, "none was captured"):
            L.gather(16, enq=0, execs=4)
        with self.assertRaisesRegex(ValueError, "neither eager"):
            L.gather(16, enq=3, execs=5)
        L.gather(16, enq=1, execs=0)  # before the agreement
        L.gather(16)
        L.gather(16, enq=1, execs=0)  # after it
        with self.assertRaisesRegex(ValueError, "before its agreement and some after"):
            L.gather(16, enq=0, execs=1)

    def ledger(self):
        return calls_of((16, 1, 1, False, "default"), (4096, 3, 3, False, "default"), (4096, 1, 1, True, "default"),
                        (4096, 4, 0, False, "default"), (4096, 0, 64, False, "default"),
                        (self.BIG, 2, 2, False, "default"), (self.BIG, 1, 1, True, "default"))

    def test_exact_match_passes(self):
        L = self.ledger()
        launches, gathers = 1 + 3 + 1 + 4, 1 + 3 + 1 + 64
        lb, b = 16 + 4096 * 8, 16 + 4096 * 68
        F, info = common.intercept_check(istats(launches, gathers, lb, b, forwarded=5, way_in="hooked"), L, self.W,
                                         "hooked")
        self.assertEqual(F, [])
        self.assertEqual(info["list_form"], "one AllGather per call")
        self.assertEqual(info["forwarded_extra"], 2)
        self.assertIn("way in: hooked", info["notes"])
        # The list form as a group of other ops: no ncclAllGather for it at all.
        F, info = common.intercept_check(istats(launches - 1, gathers - 1, lb - 4096, b - 4096, forwarded=2), L, self.W)
        self.assertEqual(F, [])
        self.assertEqual(info["list_form"], "not an AllGather (no ncclAllGather call)")
        # Bytes counted for both ranks: a note, not a failure.
        F, info = common.intercept_check(istats(launches, gathers, 2 * lb, 2 * b, forwarded=3), L, self.W)
        self.assertEqual(F, [])
        self.assertTrue(any("both ranks' bytes" in n for n in info["notes"]))

    def test_mismatches_fail(self):
        L = self.ledger()
        ok = dict(launches=9, gathers=69, launch_bytes=16 + 4096 * 8, bytes_=16 + 4096 * 68, forwarded=3)
        F, _ = common.intercept_check(istats(**dict(ok, launches=8)), L, self.W)
        self.assertIn("expected launches=9 gathers=69 (window 0 to 1048576 bytes a rank)", F[0])
        self.assertIn("or launches=8 gathers=68 if the list form is no AllGather", F[0])
        # The agreement calls went to NCCL: said so.
        F, _ = common.intercept_check(istats(**dict(ok, launches=8, gathers=68)),
                                      calls_of((16, 1, 1, False, "default"), (4096, 8, 8, False, "default")), self.W)
        self.assertTrue(any("the 1 in-window calls that made each communicator's agreement" in f for f in F), F)
        # An out-of-window call launched in place of an in-window one: the bytes give it away.
        F, _ = common.intercept_check(istats(**dict(ok, launch_bytes=ok["launch_bytes"] - 4096 + self.BIG)), L, self.W)
        self.assertEqual(F, [f"intercepted.launch_bytes={ok['launch_bytes'] - 4096 + self.BIG}, expected "
                             f"{ok['launch_bytes']} (bytes a rank of the calls counted)"])
        F, _ = common.intercept_check(istats(**dict(ok, errors=2)), L, self.W)
        self.assertEqual(F, ["intercepted.errors=2"])
        F, _ = common.intercept_check(istats(**dict(ok, forwarded=2)), L, self.W)
        self.assertIn("intercepted.forwarded=2, but 3 calls were outside the window", F[0])
        F, _ = common.intercept_check(istats(**ok, way_in="preempting"), L, self.W, "hooked")
        self.assertEqual(F, ["interceptor.way_in='preempting', expected 'hooked' (NCCL's entries hooked: every caller "
                             "reaches the library)"])
        F, _ = common.intercept_check(istats(**dict(ok, gathers=68)), L, self.W)  # one replay's gather lost
        self.assertEqual(len(F), 1)
        self.assertIn("gathers=68", F[0])
        self.assertIn("no ROCE_GATHER_STATS file", common.intercept_check(None, L, self.W)[0][0])
        self.assertIn("no \"intercepted\" section", common.intercept_check({"pid": 1}, L, self.W)[0][0])

    def test_path_off_and_way_in(self):
        L = self.ledger()
        F, _ = common.intercept_check(istats(0, 0, 0, 0, forwarded=11), L, None)
        self.assertEqual(F, [])
        F, _ = common.intercept_check(istats(1, 1, 16, 16, forwarded=10), L, None)
        self.assertIn("expected launches=0 gathers=0 (window off)", F[0])
        self.assertEqual(common.way_in_check({}, "preempting"), ([], "way in: unknown (the stats have no interceptor.way_in)"))
        self.assertEqual(common.way_in_check({"interceptor": {"way_in": "preempting"}}, "preempting"),
                         ([], "way in: preempting"))
        F, note = common.way_in_check({"interceptor": {"way_in": "hooked"}}, "preempting")
        self.assertEqual(F, ["interceptor.way_in='hooked', expected 'preempting' (LD_PRELOAD without the hook: only "
                             "callers that link NCCL)"])

    def test_judge_by_config(self):
        L = calls_of((16, 5, 5, False, "default"))
        good = istats(5, 5, 80, 80, way_in="hooked")
        self.assertEqual(launch.judge_stats("intercept-preload", good, L)[0], [])
        self.assertEqual(launch.judge_stats("intercept", good, L)[0], [])
        F, _ = launch.judge_stats("intercept", istats(5, 5, 80, 80, way_in="preempting"), L)
        self.assertEqual(F, ["interceptor.way_in='preempting', expected 'hooked' (NCCL's entries hooked: every caller "
                             "reaches the library)"])
        big = calls_of((16, 1, 1, False, "default"), (8 << 20, 2, 2, False, "default"))
        F, _ = launch.judge_stats("intercept-wide", istats(1, 1, 16, 16, forwarded=2, way_in="hooked"), big)
        self.assertEqual(F, [], "8 MiB is above intercept-wide's cap too")

    def test_cli(self):
        with tempfile.TemporaryDirectory() as d:
            L = calls_of((16, 4, 4, False, "default"))
            res, st = os.path.join(d, "r.json"), os.path.join(d, "s.json")
            with open(res, "w") as f:
                json.dump({"failures": [], "completed": True, "ledger": L}, f)
            with open(st, "w") as f:
                json.dump(istats(4, 4, 64, 64), f)
            run = lambda *a: subprocess.run([sys.executable, os.path.join(HERE, "common.py"), res, st, *a],
                                            capture_output=True, text=True)
            self.assertEqual(run("intercept:0:4096").returncode, 0)
            p = run("off")
            self.assertEqual(p.returncode, 1)
            self.assertIn("expected launches=0 gathers=0 (window off)", p.stdout)
            p = run("eager")
            self.assertEqual((p.returncode, p.stderr.strip()), (1, "common.py: 'eager' is neither intercept[:FLOOR:CAP] nor off"))

    def test_cli_window(self):
        self.assertEqual(common.cli_window("intercept:16:4096", {}), (16, 4096))
        self.assertEqual(common.cli_window("intercept", {"ROCE_GATHER_FABRIC": "tcp"}), common.default_window("tcp"))
        self.assertEqual(common.cli_window("intercept", {}), common.default_window("verbs"))
        self.assertEqual(common.cli_window("intercept", {"ROCE_GATHER_MAX_BYTES": "65536", "ROCE_GATHER_MIN_BYTES": "1"}),
                         (1, 65536))


class NcclRuntimeTest(unittest.TestCase):
    def test_decode(self):
        self.assertEqual(common.decode_nccl_version(22809), "2.28.9")
        self.assertEqual(common.decode_nccl_version(23007), "2.30.7")
        self.assertEqual(common.decode_nccl_version(2708), "2.7.8")

    @unittest.skipUnless(shutil.which("gcc"), "needs gcc")
    def test_preloaded_library_answers(self):
        """The version comes from the library LD_PRELOAD put in, not from PyTorch's headers."""
        with tempfile.TemporaryDirectory() as d:
            src, lib = os.path.join(d, "v.c"), os.path.join(d, "libnccl.so.2.30.7")
            with open(src, "w") as f:
                f.write("int ncclGetVersion(int *v) { *v = 23007; return 0; }\n")
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, src], check=True)
            code = f"import sys, json; sys.path.insert(0, {HERE!r}); import common; print(json.dumps(common.nccl_runtime()))"
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=dict(os.environ, LD_PRELOAD=lib))
            r = json.loads(p.stdout)
            self.assertEqual((r["version"], r["path"]), ("2.30.7", lib))
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            self.assertNotIn("version", json.loads(p.stdout))
            # PyTorch's own copy mapped too, as under LD_PRELOAD: the preloaded one is what runs.
            own = os.path.join(d, "libnccl.so.2")
            with open(src, "w") as f:
                f.write("int ncclGetVersion(int *v) { *v = 22809; return 0; }\n")
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", own, src], check=True)
            both = f"import ctypes; ctypes.CDLL({own!r}); " + code
            p = subprocess.run([sys.executable, "-c", both], capture_output=True, text=True,
                               env=dict(os.environ, LD_PRELOAD=lib))
            r = json.loads(p.stdout)
            self.assertEqual((r["version"], r["path"]), ("2.30.7", lib))
            self.assertEqual(sorted(r["loaded"]), sorted([lib, own]))
            p = subprocess.run([sys.executable, "-c", both], capture_output=True, text=True)
            r = json.loads(p.stdout)  # loaded privately (RTLD_LOCAL): found through the mapped files
            self.assertEqual((r["version"], r["path"]), ("2.28.9", own))


FAKE_WORKER = r'''
import json, os, sys, time
sys.path.insert(0, os.environ["TESTBED_DIR"])
import common
a = common.worker_args()
res = common.Result(a)
res.d["numbers"]["nccl"] = a.params.get("nccl", "2.28.9")
res.d["numbers"]["progress"] = "round 0 16B graph"
res.write()
print("rank", a.rank, "LD_PRELOAD", os.environ.get("LD_PRELOAD"), flush=True)
if a.params.get("hang"):
    def waiting_in_nccl():
        time.sleep(600)
    waiting_in_nccl()
res.d["completed"] = True
res.d["ledger"] = common.Ledger().n
res.write()
'''


class RunPairTest(unittest.TestCase):
    """launch.run_pair with a stand-in worker that needs no torch."""

    def setUp(self):
        self.work = tempfile.mkdtemp()
        for d in ("logs", "raw"):
            os.makedirs(os.path.join(self.work, d))
        self.worker = os.path.join(self.work, "fake_worker.py")
        with open(self.worker, "w") as f:
            f.write(FAKE_WORKER)
        self.env = mock.patch.dict(os.environ, {"TESTBED_DIR": HERE})
        self.env.start()

    def tearDown(self):
        self.env.stop()
        shutil.rmtree(self.work)

    def test_killed_pair(self):
        restarts = []
        with mock.patch.object(mps, "managed", return_value=True), \
                mock.patch.object(mps, "restart", side_effect=lambda w, why: restarts.append(why) or True):
            t0 = time.monotonic()
            rec = launch.run_pair(self.work, "t.hang", "nccl-socket", self.worker, "x", 3, {"hang": True}, nccl_lib="")
        self.assertTrue(rec["timed_out"])
        self.assertLess(time.monotonic() - t0, 15)
        self.assertIn("t.hang: still running after 3s; both ranks killed", rec["failures"])
        self.assertEqual(rec["results"][0]["numbers"]["progress"], "round 0 16B graph")  # what it wrote before
        self.assertFalse(rec["results"][0]["completed"])
        self.assertEqual(restarts, ["t.hang (timed out)"])
        self.assertEqual(rec["mps_restart"]["ok"], True)
        log = read(rec["logs"][0])
        self.assertIn("waiting_in_nccl", log)  # the stack SIGUSR1 printed
        self.assertTrue(any("waiting_in_nccl" in t for t in rec["tails"]))

    def test_clean_pair_and_nccl_check(self):
        with tempfile.TemporaryDirectory() as d:
            lib = os.path.join(d, "libnccl.so.2.30.7")
            open(lib, "w").close()
            with mock.patch.object(mps, "managed", return_value=True), mock.patch.object(mps, "restart") as r:
                rec = launch.run_pair(self.work, "t.ok", "nccl-socket", self.worker, "x", 30, {"nccl": "2.28.9"},
                                      nccl_lib=lib)
                r.assert_not_called()  # nothing was killed: MPS stays as it is
        self.assertEqual(rec["nccl"], ["2.28.9", "2.28.9"])
        self.assertEqual(len([f for f in rec["failures"] if "not 2.30.7 from LD_PRELOAD" in f]), 2)
        self.assertIn(f"LD_PRELOAD {lib}", read(rec["logs"][1]))
        rec = launch.run_pair(self.work, "t.ok2", "nccl-socket", self.worker, "x", 30, {"nccl": "2.30.7"}, nccl_lib="")
        self.assertEqual(rec["failures"], [])
        self.assertIn("LD_PRELOAD None", read(rec["logs"][0]))


# ---- the C programs, as make builds them -----------------------------------------------------

# A stand-in for the library's LD_PRELOAD way in: its ncclAllGather takes every call made by name,
# counts those within STANDIN_CAP bytes as launches (the others as forwarded), hands each to
# the next definition (the stand-in NCCL), and writes ROCE_GATHER_STATS at exit.
STANDIN_INTERCEPTOR = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
typedef int (*ag_fn)(const void*, void*, size_t, int, void*, void*);
static unsigned long long launches, launch_bytes, forwarded, forwarded_bytes;
int ncclAllGather(const void* s, void* r, size_t n, int type, void* comm, void* stream) {
  static ag_fn next;
  if (next == NULL) *(void**)&next = dlsym(RTLD_NEXT, "ncclAllGather");
  if (n <= strtoull(getenv("STANDIN_CAP"), NULL, 10)) {
    launches++;
    launch_bytes += n;
  } else {
    forwarded++;
    forwarded_bytes += n;
  }
  return next(s, r, n, type, comm, stream);
}
__attribute__((destructor)) static void write_stats(void) {
  const char* path = getenv("ROCE_GATHER_STATS");
  if (path == NULL || launches + forwarded == 0) return; /* the worker's python process made no call */
  FILE* f = fopen(path, "w");
  if (f == NULL) return;
  fprintf(f, "{\"intercepted\": {\"launches\": %llu, \"launch_bytes\": %llu, \"forwarded\": %llu, "
             "\"forwarded_bytes\": %llu, \"gathers\": %llu, \"bytes\": %llu, \"errors\": 0}, "
             "\"interceptor\": {\"way_in\": \"hooked\"}}\n",
          launches, launch_bytes, forwarded, forwarded_bytes, launches, launch_bytes);
  fclose(f);
}
"""


@unittest.skipUnless(shutil.which("gcc") and shutil.which("make"), "needs gcc and make")
class CProgramTest(unittest.TestCase):
    """build/gather-nccl and build/abort-nccl as make builds them (linked with -lnccl against a
    stand-in at link time), run against the version matrix's stand-in NCCL and libcuda through
    capi_cases.py and abort_cases.py: the cases pass, every ncclAllGather the program makes goes
    through its own slot and so reaches a library preempting the name, and intercept_check holds
    that library's counts to the worker's ledger."""

    @classmethod
    def setUpClass(cls):
        repo = launch.REPO
        p = subprocess.run(["make", "--no-print-directory", "-C", repo, "build/gather-nccl", "build/abort-nccl"],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        cls.dir = tempfile.mkdtemp()
        d = cls.dir
        with open(os.path.join(d, "interceptor.c"), "w") as f:
            f.write(STANDIN_INTERCEPTOR)
        cc = ["gcc", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"]
        testdata = os.path.join(repo, "tests", "nccl-versions", "testdata")
        cls.nccl = os.path.join(d, "nccl")
        os.makedirs(cls.nccl)
        for cmd in (cc + ["-I" + os.path.join(repo, "include"), "-DFAKE_VERSION=22803",
                          "-o", os.path.join(cls.nccl, "libnccl.so.2"), os.path.join(testdata, "fake_nccl.c"), "-ldl"],
                    cc + ["-o", os.path.join(d, "libcuda.so.1"), os.path.join(testdata, "fake_cuda.c")],
                    cc + ["-o", os.path.join(d, "interceptor.so"), os.path.join(d, "interceptor.c"), "-ldl"]):
            subprocess.run(cmd, check=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def setUp(self):
        self.work = tempfile.mkdtemp()
        for sub in ("logs", "raw", "steps"):
            os.makedirs(os.path.join(self.work, sub))

    def tearDown(self):
        shutil.rmtree(self.work)

    def test_linked_with_lnccl(self):
        for program in (steps.GATHER_NCCL, steps.ABORT_NCCL):
            if shutil.which("readelf"):
                dyn = subprocess.run(["readelf", "-dW", program], capture_output=True, text=True).stdout
                self.assertIn("Shared library: [libnccl.so.2]", dyn)
                relocs = steps.relocations(program, "ncclAllGather")
                self.assertTrue(relocs and set(relocs) <= {"R_X86_64_GLOB_DAT", "R_X86_64_JUMP_SLOT"}, relocs)
            s = steps.Step("capi", self.work, time.time() + 60)
            with contextlib.redirect_stdout(io.StringIO()):
                steps.linked_slots(s, program)
            self.assertEqual(s.d["failures"], [])
        s = steps.Step("capi", self.work, time.time() + 60)
        with mock.patch.object(steps, "relocations", return_value=[]), contextlib.redirect_stdout(io.StringIO()):
            steps.linked_slots(s, steps.GATHER_NCCL)
        self.assertEqual(s.d["failures"], ["build/gather-nccl calls ncclAllGather through no relocation slot "
                                           "(readelf -rW): nothing for the library to rebind"])

    def test_the_link_stub_says_so_when_loaded(self):
        # The stub is found at run time only under the name it was linked by, which nothing gives.
        stub = os.path.join(self.work, "stub")
        os.makedirs(stub)
        shutil.copy(os.path.join(launch.BUILD, "libnccl-stub", "libnccl.so"), os.path.join(stub, "libnccl.so.2"))
        p = subprocess.run([steps.GATHER_NCCL, "0", "0", self.work], capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, LD_LIBRARY_PATH=f"{stub}:{self.dir}"))
        self.assertEqual(p.returncode, 1)
        self.assertIn("FAIL ncclGetVersion: the link-time stand-in for libnccl.so.2 was loaded: put NCCL's "
                      "libnccl.so.2 on the library path", p.stdout)

    def pair(self, cap, worker="capi_cases.py", task="gather", params=None, expect_rcs=(0, 0)):
        cfg = {"intercept-preload": {"LD_PRELOAD": os.path.join(self.dir, "interceptor.so")}}
        with mock.patch.dict(launch.CONFIGS, cfg), mock.patch.object(launch, "LIB", cfg["intercept-preload"]["LD_PRELOAD"]), \
                mock.patch.dict(os.environ, {"PYTHONPATH": HERE}):
            rendezvous = tempfile.mkdtemp(dir=self.work)  # each pair its own, as step capi gives each run
            return launch.run_pair(self.work, "capi.t", "intercept-preload", worker, task, 60,
                                   dict({"dir": rendezvous, "device": 0, "timeout": 50}, **(params or {})),
                                   {"LD_LIBRARY_PATH": f"{self.nccl}:{self.dir}", "NCCL_NET_PLUGIN": "none",
                                    "STANDIN_CAP": str(cap)}, nccl_lib="", expect_rcs=expect_rcs,
                                   check_stats=worker == "capi_cases.py")

    def test_pair_through_the_preempted_name(self):
        cap = launch.intercept_window("intercept-preload")[1]
        rec = self.pair(cap)
        self.assertEqual(rec["failures"], [], rec["tails"])
        res = rec["results"][0]
        self.assertEqual(res["cases"], 174)  # 21 sizes x 3 seeds x in and out of place, and the burst of 48
        self.assertEqual(res["numbers"]["nccl"], "2.28.3")
        self.assertEqual(res["numbers"]["nccl_lib"], os.path.join(self.nccl, "libnccl.so.2"))
        self.assertEqual(res["numbers"]["slots"], [f"before any communicator: {self.dir}/interceptor.so",
                                                   f"after the first ncclCommInitRank: {self.dir}/interceptor.so"])
        # Every case within the window: all 174 but the 12 of 512 KiB and 512 KiB + 16 where the cap is lower.
        within = 174 - (12 if cap < 524288 else 0)
        self.assertEqual(rec["stats"][0]["intercepted"]["launches"], within)
        self.assertIn("capi.t rank 0: way in: hooked", rec["notes"])
        # A library that hands every call to NCCL fails the check: the ledger asked for them within the window.
        rec = self.pair(0)
        self.assertTrue(any(f"stats: intercepted.launches=0 gathers=0; expected launches={within} gathers={within}" in f
                            for f in rec["failures"]), rec["failures"])

    def test_abort_pair(self):
        marker = os.path.join(self.work, "raw", "abort", "died")
        os.makedirs(os.path.dirname(marker))
        rec = self.pair(1 << 20, "abort_cases.py", "abort-nccl", {"marker": marker})
        self.assertEqual(rec["failures"], [], rec["tails"])
        t = steps.abort_times(rec)
        self.assertEqual(steps.abort_verdict(t), [])
        self.assertTrue(t["api"].startswith("ncclCommAbort ("), t["api"])
        self.assertGreater(t["abort_returned_s"], 0.9)  # rank 0 aborts 1 s after it sees the death
        self.assertGreater(t["loop_gathers"], 0)


# ---- MPS ----------------------------------------------------------------------------------

FAKE_CTL = r'''#!/bin/bash
# A stand-in for nvidia-cuda-mps-control: -d starts a "daemon" and a "server" (sleeps);
# commands come on stdin, one a call.
P=$CUDA_MPS_PIPE_DIRECTORY
echo "$(date +%s) $*" >>"$CUDA_MPS_LOG_DIRECTORY/calls"
if [ "${1:-}" = -d ]; then
	[ -n "${FAKE_MPS_NO_START:-}" ] && { echo "cannot start"; exit 1; }
	sleep 300 >/dev/null 2>&1 </dev/null &
	echo $! >"$P/nvidia-cuda-mps-control.pid"
	sleep 300 >/dev/null 2>&1 </dev/null &
	echo $! >"$P/fake_server.pid"
	echo "[control] started" >>"$CUDA_MPS_LOG_DIRECTORY/control.log"
	exit 0
fi
read -r cmd arg
pid=$(cat "$P/nvidia-cuda-mps-control.pid" 2>/dev/null)
if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then echo "Cannot find MPS control daemon process"; exit 1; fi
srv=$(cat "$P/fake_server.pid" 2>/dev/null)
case "$cmd" in
get_server_list) [ -n "$srv" ] && kill -0 "$srv" 2>/dev/null && echo "$srv" ;;
get_server_status) echo "ACTIVE" ;;
get_client_list) echo "" ;;
quit) [ -n "${FAKE_MPS_STUCK:-}" ] || { kill "$pid" "$srv" 2>/dev/null; rm -f "$P/nvidia-cuda-mps-control.pid"; } ;;
*) echo "unknown command"; exit 1 ;;
esac
'''

FAKE_LIBCUDA = r'''
#include <stdlib.h>
#include <stddef.h>
static int fail(const char *name) { const char *f = getenv("FAKE_CUDA_FAIL"); return f && f[0] ? atoi(f) : 0; }
int cuInit(unsigned f) { (void)f; return 0; }
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = (void *)1; return fail("retain"); }
int cuCtxSetCurrent(void *c) { (void)c; return 0; }
int cuMemAlloc_v2(unsigned long long *p, size_t n) { (void)n; *p = 4096; return 0; }
int cuMemFree_v2(unsigned long long p) { (void)p; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
int cuGetErrorString(int rc, const char **s) { *s = rc == 46 ? "CUDA-capable device(s) is/are busy or unavailable" : "error"; return 0; }
'''


class FakeNvidia:
    """A folder with the stand-in control binary, and a stand-in libcuda.so.1 when gcc exists."""

    def __init__(self):
        self.dir = tempfile.mkdtemp()
        self.bin = os.path.join(self.dir, "bin")
        os.makedirs(self.bin)
        ctl = os.path.join(self.bin, mps.CONTROL)
        with open(ctl, "w") as f:
            f.write(FAKE_CTL)
        os.chmod(ctl, 0o755)
        self.lib = os.path.join(self.dir, "lib")
        os.makedirs(self.lib)
        src = os.path.join(self.lib, "fake.c")
        with open(src, "w") as f:
            f.write(FAKE_LIBCUDA)
        self.has_cuda = subprocess.run(["gcc", "-shared", "-fPIC", "-o", os.path.join(self.lib, "libcuda.so.1"), src],
                                       capture_output=True).returncode == 0 if shutil.which("gcc") else False

    def env(self, work):
        return {"PATH": self.bin + os.pathsep + os.environ["PATH"],
                "LD_LIBRARY_PATH": self.lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
                "CUDA_MPS_PIPE_DIRECTORY": os.path.join(work, "mps", "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": os.path.join(work, "mps", "log")}

    def close(self):
        shutil.rmtree(self.dir)


def live_fake_pids(work):
    out = []
    for name in ("nvidia-cuda-mps-control.pid", "fake_server.pid"):
        try:
            pid = int(read(os.path.join(work, "mps", "pipe", name)))
        except (OSError, ValueError):
            continue
        if mps.alive(pid):
            out.append(pid)
    return out


@unittest.skipUnless(shutil.which("bash"), "needs bash")
class MpsTest(unittest.TestCase):
    def setUp(self):
        self.fake = FakeNvidia()
        if not self.fake.has_cuda:
            self.skipTest("needs gcc for the stand-in libcuda")
        self.work = tempfile.mkdtemp()
        self.last = os.path.join(self.work, "last")
        self.patches = [mock.patch.dict(os.environ, self.fake.env(self.work)), mock.patch.object(mps, "LAST", self.last),
                        mock.patch.object(mps, "NVIDIA_BIN", os.path.join(self.work, "no-such-dir"))]
        for p in self.patches:
            p.start()

    def tearDown(self):
        for pid in live_fake_pids(self.work):
            os.kill(pid, signal.SIGKILL)
        for p in reversed(self.patches):
            p.stop()
        shutil.rmtree(self.work)
        self.fake.close()

    def test_commands(self):
        self.assertEqual(mps.start_command("/x/ctl"), ["/x/ctl", "-d"])
        self.assertEqual(mps.query_command("/x/ctl", "quit"), (["/x/ctl"], "quit\n"))
        e = mps.control_env("/x/ctl", "/p", "/l", {"PATH": "/bin"})
        self.assertEqual((e["PATH"], e["CUDA_MPS_PIPE_DIRECTORY"], e["CUDA_MPS_LOG_DIRECTORY"]), ("/x:/bin", "/p", "/l"))
        self.assertEqual(mps.find_control(), os.path.join(self.fake.bin, mps.CONTROL))
        with mock.patch.object(mps, "NVIDIA_BIN", self.fake.bin):  # /usr/local/nvidia/bin comes first
            self.assertEqual(mps.find_control(path="/nonexistent"), os.path.join(self.fake.bin, mps.CONTROL))
        self.assertIsNone(mps.find_control(path="/nonexistent"))
        self.assertEqual(mps.parse_pids("123\n 456 \nfoo 7\n"), [123, 456])

    def test_start_status_stop(self):
        self.assertTrue(mps.start(self.work))
        st = mps.load(self.work)
        self.assertTrue(st["running"])
        self.assertEqual(st["events"][-1]["what"], "start")
        self.assertIn("probe: context and 1 MiB on GPU 0", st["events"][-1]["detail"])
        self.assertEqual(read(self.last).split("\n")[0], os.environ["CUDA_MPS_PIPE_DIRECTORY"])
        pids = live_fake_pids(self.work)
        self.assertEqual(len(pids), 2)
        snap = mps.status(st["binary"], st["pipe_dir"], st["log_dir"])
        self.assertTrue(snap["daemon_answers"])
        self.assertEqual(snap["servers"][0]["status"], "ACTIVE")
        self.assertTrue(mps.stop(self.work))
        self.assertEqual(live_fake_pids(self.work), [])
        self.assertFalse(os.path.exists(self.last))
        s = mps.summary(self.work)
        self.assertTrue(s["used"])
        self.assertIn("CUDA MPS: ran", s["line"])
        self.assertIn(f"server {pids[1]} status ACTIVE", s["line"])
        self.assertIn("restarted 0 times", s["line"])
        calls = read(os.path.join(self.work, "mps", "log", "calls"))
        self.assertIn(" -d\n", calls)

    def test_stuck_quit_is_killed_and_restart(self):
        self.assertTrue(mps.start(self.work))
        pids = live_fake_pids(self.work)
        with mock.patch.dict(os.environ, {"FAKE_MPS_STUCK": "1"}):
            self.assertTrue(mps.restart(self.work, "p.x (timed out)"))
        for pid in pids:
            self.assertFalse(mps.alive(pid))
        st = mps.load(self.work)
        stop_ev = [e for e in st["events"] if e["what"] == "stop-for-restart"][0]
        self.assertFalse(stop_ev["ok"])
        self.assertIn("killed (SIGKILL)", stop_ev["detail"])
        self.assertEqual(st["restarts"], 1)
        self.assertEqual(len(live_fake_pids(self.work)), 2)  # a fresh daemon
        mps.stop(self.work)
        self.assertIn("restarted 1 times (p.x (timed out))", mps.summary(self.work)["line"])

    def test_probe_fails_then_gives_up(self):
        with mock.patch.dict(os.environ, {"FAKE_CUDA_FAIL": "46"}), mock.patch.object(mps, "RETRY_S", 0):
            self.assertFalse(mps.start(self.work))
            self.assertIn("busy or unavailable", mps.load(self.work)["events"][-1]["detail"])
            self.assertFalse(mps.restart(self.work, "p.y (cut short)"))
            self.assertFalse(mps.restart(self.work, "p.z"))  # given up: no third try
        self.assertEqual(live_fake_pids(self.work), [])
        s = mps.summary(self.work)
        self.assertFalse(s["used"])
        self.assertIn("did not start", s["line"])

    def test_no_binary(self):
        with mock.patch.dict(os.environ, {"PATH": "/usr/bin:/bin"}):
            self.assertFalse(mps.start(self.work))
        self.assertIn("neither in", mps.summary(self.work)["line"])

    def test_previous_daemon_stopped(self):
        self.assertTrue(mps.start(self.work))
        old = live_fake_pids(self.work)
        # A second run in another work dir: it stops the first one's daemon before its own.
        work2 = tempfile.mkdtemp()
        try:
            with mock.patch.dict(os.environ, self.fake.env(work2)):
                self.assertTrue(mps.start(work2))
                self.assertTrue(any(e["what"] == "stop-previous" for e in mps.load(work2)["events"]))
                for pid in old:
                    self.assertFalse(mps.alive(pid))
                mps.stop(work2)
        finally:
            for pid in live_fake_pids(work2):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(work2)


# ---- the steps from canned records -----------------------------------------------------------

def samples_for(us_by_size, n=3, jitter=0.02):
    return {str(b): [us * (1 + jitter * (i - 1)) for i in range(n)] for b, us in us_by_size.items()}


def ledger_for(sizes, eager=16, captured=4, replays=200):
    """A bench-like ledger: per size, eager calls, then captured ones, then the gathers of their replays."""
    L = common.Ledger()
    for b in sizes:
        L.gather(b, enq=eager, execs=eager)
        L.gather(b, enq=captured, execs=0)
        L.gather(b, enq=0, execs=replays)
    return L.n


def istats_for(ledger, config):
    """The stats of a run whose every call took the path its window gives (intercept_expectation)."""
    e = common.intercept_expectation(ledger["calls"], launch.intercept_window(config), True)
    return istats(e["launches"], e["gathers"], e["launch_bytes"], e["bytes"], forwarded=e["forwarded_min"],
                  way_in=launch.way_in(config), proxy_naps=3, proxy_woke_to_work=1)


def record(run, config, numbers, work, timed_out=False, failures=None, nccl="2.28.9", stats=True, completed=True,
           sizes=None, results=None):
    sizes = sizes or [int(b) for b in (numbers.get("samples", {}).get("graph") or {})]
    led = ledger_for(sizes)
    res = {"completed": completed and not timed_out, "failures": [], "n_failures": 0, "cases": 0,
           "numbers": dict(numbers, nccl=nccl), "ledger": led}
    logs = []
    for r in (0, 1):
        p = os.path.join(work, "logs", f"{run}.rank{r}.log")
        with open(p, "w") as f:
            f.write(f"NCCL INFO NCCL version {nccl}+cuda13.0\n")
        logs.append(p)
    st = istats_for(led, config) if stats and launch.uses_plugin(config) else None
    return {"run": run, "config": config, "seconds": 12.0, "rcs": [0, 0], "limit": 45, "exit_times": [0, 0],
            "timed_out": timed_out, "cut_short": False, "results": results or [res, json.loads(json.dumps(res))],
            "stats": [st, st], "logs": logs, "failures": list(failures or []) + (
                [f"{run}: still running after 45s; both ranks killed"] if timed_out else []),
            "notes": [], "tails": [], "nccl": [nccl, nccl], "nccl_lib": None, "mps_restart": None}


# A stand-in ptxas: it logs its arguments, says its release, knows the arches in KNOWN, fails
# on BAD as ptxas fails on a PTX error, and writes the output file otherwise.
FAKE_PTXAS = """#!/bin/sh
echo "$@" >>"$PTXAS_LOG"
if [ "$1" = --version ]; then
  printf 'ptxas: NVIDIA (R) Ptx optimizing assembler\\nCuda compilation tools, release 13.0, V13.0.48\\n'
  exit 0
fi
arch=${1#-arch=}
case " $KNOWN " in *" $arch "*) ;; *) echo "ptxas fatal   : Value '$arch' is not defined for option 'gpu-name'" >&2; exit 255 ;; esac
if [ "$arch" = "$BAD" ]; then
  echo "ptxas $4, line 40; error   : Instruction 'fence.proxy' requires .target sm_90 or higher" >&2
  echo "ptxas fatal   : Ptx assembly aborted due to errors" >&2
  exit 255
fi
: >"$3"
"""


class PtxasTest(unittest.TestCase):
    """The env step's ptxas check of the one-shot kernel's PTX for sm_90, sm_100, sm_120 and
    sm_121, against a stand-in ptxas."""

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.ptxas = os.path.join(self.dir, "ptxas")
        with open(self.ptxas, "w") as f:
            f.write(FAKE_PTXAS)
        os.chmod(self.ptxas, 0o755)
        self.log = os.path.join(self.dir, "log")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def check(self, known="sm_90 sm_100 sm_120 sm_121", bad="", ptxas=None, ptx=None):
        s = steps.Step("env", self.dir, time.time() + 60)
        env = {"PTXAS_LOG": self.log, "KNOWN": known, "BAD": bad}
        with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(io.StringIO()):
            rec = steps.ptxas_check(s, ptx=ptx, ptxas=self.ptxas if ptxas is None else ptxas)
        return s.finish(), rec

    def test_every_arch_assembles(self):
        d, rec = self.check()
        self.assertEqual(d["failures"], [])
        self.assertEqual(d["numbers"]["ptxas"], rec)
        self.assertEqual(rec["release"], "13.0")
        self.assertEqual(rec["ptx"], "kernels/oneshot.ptx")
        self.assertEqual(rec["arches"], {"sm_90": "ok", "sm_100": "ok", "sm_120": "ok", "sm_121": "ok"})
        self.assertIn("ptxas (CUDA 13.0) on kernels/oneshot.ptx: sm_90 ok, sm_100 ok, sm_120 ok, sm_121 ok", d["notes"])
        calls = read(self.log).splitlines()
        self.assertEqual(calls[0], "--version")
        ptx = os.path.join(launch.REPO, "kernels", "oneshot.ptx")
        self.assertEqual([c.split()[0] for c in calls[1:]], ["-arch=sm_90", "-arch=sm_100", "-arch=sm_120", "-arch=sm_121"])
        for c, arch in zip(calls[1:], steps.PTXAS_ARCHES):
            args = c.split()
            self.assertEqual((args[1], args[3]), ("-o", ptx))
            self.assertTrue(args[2].endswith("/" + arch + ".cubin"), args[2])

    def test_an_older_ptxas_that_lacks_sm_121_fails_the_step_saying_so(self):
        d, rec = self.check(known="sm_90 sm_100 sm_120")
        self.assertEqual(rec["arches"]["sm_120"], "ok")
        self.assertEqual(rec["arches"]["sm_121"], "this ptxas does not know sm_121 (a newer CUDA does): not checked")
        self.assertEqual(d["status"], "fail")
        self.assertEqual(d["failures"], ["ptxas (CUDA 13.0) -arch=sm_121 kernels/oneshot.ptx: "
                                         "this ptxas does not know sm_121 (a newer CUDA does): not checked"])

    def test_a_refused_ptx_fails_the_step_with_ptxas_words(self):
        d, rec = self.check(bad="sm_100")
        self.assertEqual([a for a, v in rec["arches"].items() if v != "ok"], ["sm_100"])
        self.assertTrue(rec["arches"]["sm_100"].startswith("refused (exit 255): ptxas "), rec["arches"]["sm_100"])
        self.assertIn("line 40; error   : Instruction 'fence.proxy' requires .target sm_90 or higher | "
                      "ptxas fatal   : Ptx assembly aborted due to errors", rec["arches"]["sm_100"])
        self.assertEqual(len(d["failures"]), 1)
        self.assertIn("sm_90 ok, sm_100 FAILED, sm_120 ok, sm_121 ok", d["notes"][0])

    def test_no_ptxas_or_no_ptx_fails_the_step(self):
        with mock.patch.object(steps, "find_ptxas", return_value=None):
            d, rec = self.check(ptxas="")
        self.assertEqual(d["failures"], ["no ptxas (on PATH, beside nvcc or in /usr/local/cuda/bin): kernels/oneshot.ptx "
                                         "is not checked for sm_90, sm_100, sm_120, sm_121"])
        self.assertEqual(rec["arches"], {})
        d, rec = self.check(ptx=os.path.join(launch.REPO, "kernels", "absent.ptx"))
        self.assertEqual(d["failures"], ["kernels/absent.ptx does not exist"])
        self.assertFalse(os.path.exists(self.log), "ptxas was not run")

    def test_find_ptxas_looks_on_path_then_beside_nvcc(self):
        with mock.patch.dict(os.environ, {"PATH": self.dir}):
            self.assertEqual(steps.find_ptxas(), self.ptxas)
        cuda = os.path.join(self.dir, "cuda", "bin")
        os.makedirs(cuda)
        for name in ("nvcc", "ptxas"):
            with open(os.path.join(cuda, name), "w") as f:
                f.write("#!/bin/sh\n")
            os.chmod(os.path.join(cuda, name), 0o755)
        # No ptxas on PATH, nvcc on it: the ptxas beside nvcc.
        with mock.patch.object(shutil, "which", side_effect=lambda n: os.path.join(cuda, "nvcc") if n == "nvcc" else None):
            self.assertEqual(steps.find_ptxas(), os.path.join(cuda, "ptxas"))


class StepHarness(unittest.TestCase):
    """A work dir, and run_step: a step run against a fake launch.run_pair."""

    def setUp(self):
        self.work = tempfile.mkdtemp()
        for d in ("logs", "raw", "steps"):
            os.makedirs(os.path.join(self.work, d))
        self.out = io.StringIO()

    def tearDown(self):
        shutil.rmtree(self.work)

    def run_step(self, name, fake, env=None):
        s = steps.Step(name, self.work, time.time() + 600)
        with mock.patch.object(launch, "run_pair", side_effect=fake), mock.patch.dict(os.environ, env or {}), \
                contextlib.redirect_stdout(self.out):
            getattr(steps, "step_" + name)(s)
        d = s.finish()
        with open(os.path.join(self.work, "steps", name + ".json"), "w") as f:
            json.dump(d, f)
        with open(os.path.join(self.work, "steps", name + ".meta"), "w") as f:
            f.write("0 10")
        return d


class StepsTest(StepHarness):

    def test_latency_fails_without_data(self):
        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            return record(run, config, {"samples": {}, "agreed": False}, work, timed_out=True, sizes=[16])
        d = self.run_step("latency", fake, {"ROCE_GATHER_GPU_LATENCY_ROUNDS": "1"})
        self.assertEqual(d["status"], "fail")
        self.assertIn("no graph-replay samples: nothing measured", d["failures"])

    def test_calibrate(self):
        sizes = calibrate.SIZES
        seen = []

        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            self.assertFalse(kw.get("check_stats", True))
            role = params["role"]
            seen.append((role, config, params["cap"], params["sizes"]))
            us = {b: 30 + b / 4096 for b in sizes}
            if role == "intercept":
                us = {b: (v * 0.7 if 4096 <= b <= 131072 else v * 1.4) for b, v in us.items()}
            rec = record(run, config, {"samples": {"graph": samples_for(us)}, "agreed": True}, work, sizes=sizes)
            for res in rec["results"]:
                res["params"] = params
            return rec
        d = self.run_step("calibrate", fake)
        self.assertEqual(d["status"], "pass", d["failures"])
        self.assertEqual([x[:3] for x in seen], [("nccl", "nccl-socket", launch.WIDE_CAP),
                                                 ("intercept", "intercept-wide", launch.WIDE_CAP),
                                                 ("intercept", "intercept-wide", launch.WIDE_CAP),
                                                 ("nccl", "nccl-socket", launch.WIDE_CAP)])
        self.assertEqual(seen[0][3][-1], 4 << 20)  # 16 B to 4 MiB
        self.assertEqual(d["numbers"]["window"]["floor"], 4096)
        self.assertEqual(d["numbers"]["window"]["cap"], 131072)
        self.assertEqual(d["numbers"]["env"], "export ROCE_GATHER_MIN_BYTES=4096 ROCE_GATHER_MAX_BYTES=131072")
        self.assertIn("intercepted/NCCL", d["md"][0])

    def test_calibrate_wrong_path_gives_no_answer(self):
        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            rec = record(run, config, {"samples": {"graph": samples_for({16: 10})}, "agreed": True}, work, sizes=[16])
            if params["role"] == "intercept":
                for st in rec["stats"]:
                    st["intercepted"].update(launches=0, gathers=0)
            return rec
        d = self.run_step("calibrate", fake)
        self.assertEqual(d["status"], "fail")
        self.assertIsNone(d["numbers"]["env"])
        self.assertTrue(any("rank 1 stats: intercepted.launches=0" in f for f in d["failures"]), d["failures"])
        self.assertTrue(any("calibrate.1.intercept stats: intercepted.launches=0" in f for f in d["failures"]))

    def intercept_latency_fake(self, calls, shape=None):
        """A fake pair of bench.py: socket 30 + b/2048 µs; intercept 0.5x of it to 64 KiB, 0.8x to 256 KiB, then
        equal; preload and nonap as intercept. shape(config, bytes, us) may change one."""
        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((run, config, params))
            sock = {b: 30 + b / 2048 for b in params["sizes"]}
            f = {"nccl-socket": lambda b: 1.0}.get(config, lambda b: 0.5 if b <= 65536 else 0.8 if b <= 262144 else 1.0)
            us = {b: v * f(b) for b, v in sock.items()}
            if shape:
                us = {b: shape(config, b, v) for b, v in us.items()}
            return record(run, config, {"samples": {"graph": samples_for(us)}, "agreed": True}, work,
                          sizes=params["sizes"])
        return fake

    def test_latency_intercept(self):
        calls = []
        d = self.run_step("latency", self.intercept_latency_fake(calls))
        n = len(plans.LATENCY_CONFIGS)
        self.assertEqual(plans.LATENCY_CONFIGS, ["nccl-socket", "intercept", "intercept-preload", "intercept-nonap"])
        self.assertEqual(len(calls), n * plans.LATENCY_ROUNDS)
        self.assertEqual([c[1] for c in calls[:n]], plans.LATENCY_CONFIGS)
        self.assertEqual([c[1] for c in calls[n:2 * n]], plans.LATENCY_CONFIGS[1:] + plans.LATENCY_CONFIGS[:1])
        self.assertEqual(calls[0][2]["sizes"], [1 << k for k in range(4, 23)])
        self.assertEqual(calls[0][2]["modes"], ["graph"])
        self.assertEqual(d["status"], "pass", d["failures"] + d["notes"])
        self.assertEqual([g["pass"] for g in d["numbers"]["goals"]], [True] * 4)
        self.assertIn("goals met: 4/4", d["headline"])
        self.assertEqual(d["numbers"]["window"], launch.intercept_window("intercept"))
        md = d["md"][0]
        self.assertIn("| 64 KiB | intercepted |", md)
        self.assertIn("| 4 MiB | NCCL (outside the window) |", md)
        self.assertIn("| intercept | 4 |", d["md"][1])  # the proxy's naps: 4 pairs
        with open(os.path.join(self.work, "latency.csv")) as f:
            self.assertEqual(len(list(csv.DictReader(f))), n * plans.LATENCY_ROUNDS * 19 * 3)
        rows = {r["bytes"]: r for r in d["numbers"]["compare"]["rows"]}
        self.assertAlmostEqual(rows[16]["ratio"]["median"], 0.5)

    def test_latency_intercept_goals_missed(self):
        def shape(config, b, us):
            if config == "intercept" and b == 65536:
                return us * 1.4  # 0.70x of socket
            if config == "intercept" and b == 4 << 20:
                return us * 1.5  # NCCL's own path in intercept, yet slower than socket
            if config == "intercept-nonap" and b == 4096:
                return us * 0.5  # the nap shows
            return us
        d = self.run_step("latency", self.intercept_latency_fake([], shape), {"ROCE_GATHER_GPU_LATENCY_ROUNDS": "2"})
        self.assertEqual(d["status"], "warn")  # a finding about speed, not a broken test
        g = d["numbers"]["goals"]
        self.assertEqual([x["pass"] for x in g], [False, True, False, False])
        self.assertEqual([tuple(x) for x in g[0]["failed"]], [(65536, "0.70x")])
        self.assertEqual([b for b, _ in g[2]["failed"]], [4 << 20])
        self.assertEqual([b for b, _ in g[3]["failed"]], [4096, 65536])  # nonap faster at 4 KiB, intercept slowed at 64
        self.assertTrue(any(n.startswith("goal missed: intercept's median <= 0.65x") and "64 KiB (0.70x)" in n
                            for n in d["notes"]))

    def test_latency_rounds_fit_the_step(self):
        clock = [1000.0]
        fake = self.intercept_latency_fake([])

        def slow(*a, **kw):
            clock[0] += 60  # every pair takes 60 s: a round 240 s
            return fake(*a, **kw)
        s = steps.Step("latency", self.work, 1000.0 + 600)
        with mock.patch.object(launch, "run_pair", side_effect=slow), mock.patch.object(steps.time, "time",
                                                                                        lambda: clock[0]), \
                contextlib.redirect_stdout(self.out):
            steps.step_latency(s)
        d = s.finish()
        self.assertEqual(d["numbers"]["rounds"], 2)
        self.assertIn("rounds 3 to 4 not started: 114s left in the step, a round took up to 240s", d["notes"])
        self.assertEqual(d["failures"], [])

    def test_gather_intercept(self):
        calls = []

        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((config, params))
            res = {"completed": True, "failures": [], "n_failures": 0, "cases": 500, "digests": {"a": "1", "b": "2"},
                   "numbers": {"nccl": "2.28.9"}, "ledger": ledger_for([16])}
            if config == "intercept-preload":
                res = dict(res, digests={"a": "1", "b": "X"})
            return record(run, config, {}, work, results=[res, json.loads(json.dumps(res))], sizes=[16])
        d = self.run_step("gather", fake)
        self.assertEqual([c for c, _ in calls], ["nccl-socket", "intercept", "intercept-preload"])
        cap = launch.intercept_window("intercept")[1]
        for _, p in calls:
            self.assertEqual((p["extra_shards"], p["groups"]), ([cap + 16], True))
        self.assertEqual(len({p["port2"] for _, p in calls}), 3)  # a fresh port for each pair's second default group
        self.assertEqual(d["failures"], ["rank 0 b: output of intercept-preload differs from nccl-socket",
                                         "rank 1 b: output of intercept-preload differs from nccl-socket"])
        self.assertTrue(d["headline"].endswith("every in-window gather intercepted: intercept"), d["headline"])
        self.assertTrue(any("the intercepted path" in m for m in d["md"]))

    def test_graphs_intercept(self):
        calls = []

        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((run, config, params, extra_env))
            res = {"completed": True, "failures": [], "n_failures": 0, "cases": 9, "numbers": {"sizes": params["sizes"]},
                   "ledger": ledger_for(params["sizes"])}
            return record(run, config, {}, work, results=[res, dict(res)], sizes=params["sizes"])
        d = self.run_step("graphs", fake)
        cap = launch.intercept_window("intercept")[1]
        self.assertEqual([(c[0], c[1]) for c in calls], [("graphs.intercept.nccl-info", "intercept")])
        self.assertEqual(calls[0][2], {"sizes": [16, 4096, 65536, 524288, 2 * cap], "replays": 64})
        self.assertEqual(calls[0][3]["NCCL_DEBUG"], "INFO")
        self.assertEqual(d["headline"], "5 gathers x 64 replays: 1/1 configs byte-exact")

    def test_capi_intercept(self):
        calls = []

        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((run, config, params))
            res = {"completed": True, "failures": [], "n_failures": 0, "cases": 174, "ledger": ledger_for([16]),
                   "numbers": {"slots": ["before any communicator: /usr/lib/libnccl.so.2",
                                         "after the first ncclCommInitRank: /r/build/libroce_gather.so"]}}
            return record(run, config, {}, work, results=[res, dict(res)], sizes=[16])

        program = os.path.join(self.work, "gather-nccl")
        open(program, "w").close()
        with mock.patch.object(steps, "GATHER_NCCL", program), \
                mock.patch.object(steps, "relocations", return_value=["R_X86_64_GLOB_DAT"]):
            d = self.run_step("capi", fake)
        self.assertEqual([(r, c) for r, c, _ in calls], [("capi.nccl-socket", "nccl-socket"), ("capi.intercept", "intercept")])
        self.assertNotIn("program", calls[1][2])  # capi_cases.py runs build/gather-nccl
        self.assertEqual(d["failures"], [])
        self.assertEqual(d["numbers"]["ncclAllGather_relocations"], ["R_X86_64_GLOB_DAT"])
        self.assertIn("gather-nccl (ncclAllGather through R_X86_64_GLOB_DAT): 174 cases a rank; byte-exact and "
                      "stats consistent: 2/2 runs", d["headline"])
        self.assertTrue(any("leads to before any communicator: /usr/lib/libnccl.so.2; after" in n for n in d["notes"]))
        calls.clear()
        with mock.patch.object(steps, "GATHER_NCCL", os.path.join(self.work, "absent")):
            d = self.run_step("capi", fake)
        self.assertEqual(d["failures"], [f"{os.path.relpath(os.path.join(self.work, 'absent'), launch.REPO)} is missing "
                                         "(make all builds it)"])
        self.assertEqual(calls, [])

    def jax_fake(self, seen, taken, why, psum="same"):
        """A JAX pair: 3 grouped gathers of 16 B a rank, then 2 psums of 16 B; taken: the stats show the
        gathers on the path (the first at NCCL) on both ranks; psum: the stats show the psums on the
        path on the gathers' communicator ("same"), on one of their own ("own": the first to NCCL),
        none of them reaching the wrapper ("none"), or off the path ("off"); why: a line the logs hold."""
        L, alt = common.Ledger(), common.Ledger()
        for _ in range(3):
            L.gather(16, grouped=True)
            alt.gather(16, grouped=True)
        for _ in range(2):
            L.allreduce(16, "sum", "float32", grouped=True)
            alt.allreduce(16, "sum", "float32", grouped=True, comm="psum")

        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            seen.append(dict(config=config, params=params, check_stats=kw.get("check_stats")))
            res = {"completed": True, "failures": [], "n_failures": 0, "cases": 5,
                   "numbers": {"jax": "0.7", "psum_own_comm_ledger": json.loads(json.dumps(alt.n))},
                   "ledger": json.loads(json.dumps(L.n))}
            rec = record(run, config, {}, work, results=[res, dict(res)], sizes=[16])
            st = istats(2, 2, 32, 32, forwarded=1, way_in="hooked") if taken[config] else \
                istats(0, 0, forwarded=3, way_in="refused")
            n = {"same": 2, "own": 1, "none": 0, "off": 0}[psum] if taken[config] else 0
            st[common.AR_SECTION] = {"launches": n, "allreduces": n, "forwarded": 2 - n, "errors": 0}
            st.setdefault("interceptor", {})["ncclAllReduce"] = 0 if psum == "none" else 2
            rec["stats"] = [st, st]
            with open(rec["logs"][1], "a") as f:
                f.write(why.get(config, "") + "\n")
            return rec
        return fake

    def test_jax_intercept_takes_the_path_or_says_why(self):
        seen = []
        refused = ("NCCL INFO NET/roce_gather : interceptor: not hooking /x/libnccl.so.2's entries, none is patched: "
                   "ncclAllGather (first bytes cc 90 90 90 90): at +0: an opcode the decoder does not take (bytes cc)")
        d = self.run_step("jax", self.jax_fake(seen, {"intercept": False, "intercept-preload": True},
                                               {"intercept": refused}))
        cap = launch.allreduce_window("intercept")[1]
        psums = [["float32", 16], ["float32", 4096], ["bfloat16", 8192], ["int32", 65536], ["bfloat16", cap + 2]]
        self.assertEqual(seen, [{"config": c, "params": {"seeds": 1, "psum": psums}, "check_stats": False}
                                for c in ("intercept", "intercept-preload")])
        # The gathers of intercept took NCCL's path, with the line saying why: its psums are not judged.
        self.assertEqual(d["numbers"]["psum"], {"intercept": "NCCL's path, as the gathers'",
                                                "intercept-preload": "intercepted on both ranks (on the gathers' "
                                                                     "communicator)"})
        self.assertEqual(d["status"], "pass", d["failures"])
        self.assertEqual(d["numbers"]["path"]["intercept-preload"], "intercepted on both ranks")
        self.assertTrue(d["numbers"]["path"]["intercept"].startswith("NCCL's path: ") and
                        "none is patched" in d["numbers"]["path"]["intercept"], d["numbers"]["path"])
        # Not taken, and nothing says why (the hooked line, and a failed agreement, are no
        # reasons): a failure.
        unreached = ("NCCL INFO NET/roce_gather : interceptor: hooked the entries of /x/libnccl.so.2's ncclAllGather"
                     "\nNCCL WARN NET/roce_gather : communicator 0x1: the "
                     "one-shot agreement failed, so every ncclAllGather on it returns error 5")
        d = self.run_step("jax", self.jax_fake([], {"intercept": False, "intercept-preload": False},
                                               {"intercept": refused, "intercept-preload": unreached}))
        self.assertEqual(d["status"], "fail")
        self.assertEqual(len(d["failures"]), 1, d["failures"])
        self.assertIn("jax.intercept-preload: the gathers did not take the intercepted path (rank 0: "
                      "interceptor.way_in='refused', expected 'hooked'", d["failures"][0])
        self.assertIn("rank 1: intercepted.launches=0 gathers=0; expected launches=2 gathers=2", d["failures"][0])

    def test_jax_psum(self):
        both = {"intercept": True, "intercept-preload": True}
        d = self.run_step("jax", self.jax_fake([], both, {}, psum="own"))
        self.assertEqual(d["status"], "pass", d["failures"])
        self.assertEqual(set(d["numbers"]["psum"].values()), {"intercepted on both ranks (on a communicator of their own)"})
        d = self.run_step("jax", self.jax_fake([], both, {}, psum="none"))
        self.assertEqual(d["status"], "warn", d["failures"])
        self.assertIn("jax.intercept: 2 psums a rank, but 0 and 0 ncclAllReduce calls reached the library's wrapper: XLA "
                      "did not issue them as ncclAllReduce", d["notes"])
        d = self.run_step("jax", self.jax_fake([], both, {}, psum="off"))
        self.assertEqual(d["status"], "fail")
        self.assertEqual(d["failures"][0], "jax.intercept psum: rank 0: intercepted_allreduce.launches=0 allreduces=0; "
                                           f"expected launches=2 allreduces=2 (all-reduce window 0 to "
                                           f"{launch.allreduce_window('intercept')[1]} bytes); the difference is exactly "
                                           "the calls of sum/float32: the library leaves them to NCCL")

    def test_pynccl_step(self):
        calls = []

        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((run, config, worker, params, extra_env))
            res = {"completed": True, "failures": [], "n_failures": 0, "cases": 42, "numbers": {},
                   "digests": {"pynccl/plain/16B": "aa", "pynccl/graph/replay0/16B": "bb"},
                   "ledger": ledger_for([16], 524288)}
            if config == "intercept-preload":
                res["digests"] = dict(res["digests"], **{"pynccl/graph/replay0/16B": "cc"})
            if extra_env:
                report = extra_env["ROCE_GATHER_BIND_REPORT"].replace("%p", "7")
                with open(report, "w") as f:
                    f.write('{"pid":7,"event":"nccl","path":"/t/libnccl.so.2","version":22809,"found_by":"the NCCL that '
                            'loaded this library","missing":[]}\n{"pid":7,"event":"hooked","at":"NCCL init",'
                            '"functions":["ncclAllGather","ncclGroupEnd"]}\n{"pid":7,"event":"way","way":"hooked"}\n')
            return record(run, config, {}, work, results=[res, json.loads(json.dumps(res))], sizes=[16])
        with mock.patch.object(steps, "window_cap", return_value=262144):
            d = self.run_step("pynccl", fake)
        self.assertEqual([(r, c, w) for r, c, w, _, _ in calls],
                         [("pynccl.nccl-socket", "nccl-socket", "pynccl_cases.py"),
                          ("pynccl.intercept-env", "intercept-env", "pynccl_cases.py"),
                          ("pynccl.intercept-preload", "intercept-preload", "pynccl_cases.py")])
        cap = launch.allreduce_window("intercept-env")[1]
        self.assertEqual(calls[0][3], {"sizes": [16, 100, 1024, 4096, 65536, 262144, 262160], "replays": 8,
                                       "allreduce": {"cases": [list(c) for c in arcases.pynccl_cases(cap)], "replays": 4}})
        self.assertEqual(calls[0][3]["allreduce"]["cases"][:6], [["sum", "bfloat16", n] for n in
                                                                 (8, 50, 4096, 32768, cap // 2, cap // 2 + 1)])
        self.assertIsNone(calls[0][4])
        self.assertTrue(calls[1][4]["ROCE_GATHER_BIND_REPORT"].endswith("raw/pynccl.intercept-env.bind.%p.jsonl"))
        # The preload run's replay differs from nccl-socket's: a failure naming it; the env run passes.
        self.assertEqual(d["status"], "fail")
        self.assertEqual(d["failures"], [f"rank {r} pynccl/graph/replay0/16B: output of intercept-preload differs from "
                                         "nccl-socket" for r in (0, 1)])
        self.assertIn("every in-window call intercepted: intercept-env", d["headline"])
        self.assertTrue(any("7: hooked at NCCL init: 2 functions" in m for m in d["md"]), d["md"])

    def abort_fake(self, calls, launches=5):
        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((run, config, params))
            n = {"died_at": 100.0, "seen_at": 100.01, "abort_called_at": 101.0, "abort_returned_at": 101.5,
                 "api": "ncclCommAbort"}
            res = {"completed": True, "failures": [], "n_failures": 0, "cases": 5, "numbers": n, "ledger": None}
            rec = record(run, config, {}, work, results=[res, dict(res, numbers={})], sizes=[16])
            rec["exit_times"] = [102.0, 100.0]
            if launch.uses_plugin(config):
                rec["stats"] = [istats(launches, launches, way_in="hooked"), None]
            return rec
        return fake

    def test_abort_intercept(self):
        calls = []
        program = os.path.join(self.work, "abort-nccl")
        open(program, "w").close()
        with mock.patch.object(steps, "ABORT_NCCL", program):
            d = self.run_step("abort", self.abort_fake(calls))
            self.assertEqual([(r, c) for r, c, _ in calls], [("abort-nccl.nccl-socket", "nccl-socket"),
                                                              ("abort-nccl.intercept", "intercept"),
                                                              ("abort.nccl-socket", "nccl-socket"),
                                                              ("abort.intercept", "intercept")])
            self.assertEqual(d["failures"], [])
            self.assertEqual(d["numbers"]["abort-nccl.intercept"]["abort_returned_s"], 1.5)
            d = self.run_step("abort", self.abort_fake([], launches=0))
        self.assertEqual(d["failures"], [f"{r} rank 0: no gather took the intercepted path (intercepted.launches 0): its "
                                         "abort was not tested" for r in ("abort-nccl.intercept", "abort.intercept")])
        calls = []
        with mock.patch.object(steps, "ABORT_NCCL", os.path.join(self.work, "absent")):  # PyTorch's runs still go
            d = self.run_step("abort", self.abort_fake(calls))
        self.assertEqual([r for r, _, _ in calls], ["abort.nccl-socket", "abort.intercept"])
        self.assertEqual(len(d["failures"]), 2)
        self.assertIn("abort-nccl.nccl-socket: ", d["failures"][0])
        self.assertIn("is missing (make all builds it)", d["failures"][0])

    def test_report_intercept(self):
        self.run_step("latency", self.intercept_latency_fake([]), {"ROCE_GATHER_GPU_LATENCY_ROUNDS": "1"})
        out = os.path.join(self.work, "out")
        argv = ["report.py", "--work", self.work, "--out", out, "--steps", "latency", "--start", str(time.time())]
        with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(self.out):
            with self.assertRaises(SystemExit) as e:
                report.main()
        self.assertEqual(e.exception.code, 0)
        text = self.out.getvalue()
        self.assertIn("intercept/nccl-socket", text)
        self.assertIn("goal met: intercept's median <= 0.65x NCCL socket's, 16 B to 64 KiB", text)
        self.assertIn("4194304", text)  # every size, 16 B to 4 MiB
        self.assertIn("## latency: pass", read(os.path.join(out, "summary.md")))

    def recreate_fake(self, shape_by_case, seen=None):
        """A re-create pair: recreate_rec's record, each case shaped by shape_by_case[case](rec) if given;
        PyTorch's NCCL is 2.28.9, ROCE_GATHER_GPU_NCCL_LIB's 2.30.7."""
        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            case = run.split(".", 1)[1]
            if seen is not None:
                seen.append((case, config, params, extra_env.get(plans.REF_COUNT), kw.get("nccl_lib")))
            nccl = "2.30.7" if kw.get("nccl_lib") else "2.28.9"
            rec = record(run, config, {}, work, nccl=nccl, sizes=[16])
            canned = recreate_rec(stats=None if launch.uses_plugin(config) else {})
            rec.update(results=canned["results"], stats=canned["stats"] if launch.uses_plugin(config) else [None, None])
            for res in rec["results"]:
                res["numbers"]["nccl"] = nccl
            if case in shape_by_case:
                shape_by_case[case](rec)
            return rec
        return fake

    def test_recreate_not_needed(self):
        seen = []
        d = self.run_step("recreate", self.recreate_fake({}, seen), {"ROCE_GATHER_GPU_NCCL_LIB": ""})
        self.assertEqual(d["status"], "pass", d["failures"])
        self.assertEqual([c[:2] + c[3:] for c in seen], [("intercept", "intercept", None, ""),
                                                         ("intercept-refcount1", "intercept", "1", ""),
                                                         ("nccl-socket", "nccl-socket", None, "")])
        cap = launch.intercept_window("intercept")[1]
        self.assertEqual({p["above"] for _, _, p, _, _ in seen}, {cap + 16})
        self.assertEqual(len({p["port2"] for _, _, p, _, _ in seen}), 3)
        self.assertEqual(d["numbers"]["ref_count_needed"], {"2.28.9": "not needed"})
        self.assertEqual(d["numbers"]["intercept"]["status"], "ok")
        self.assertEqual(d["headline"], "3/3 cases ok; NCCL_NET_PLUGIN_REF_COUNT=1 not needed on NCCL 2.28.9; PyTorch's "
                                        "NCCL only (no ROCE_GATHER_GPU_NCCL_LIB)")
        self.assertIn("| intercept | 2.28.9 | unset | ok: both process groups byte-exact, every in-window gather "
                      "intercepted | 6 / 6 |", d["md"][0])

    def test_recreate_needed_is_a_warning(self):
        def first_only(rec):
            L = rec["results"][0]["numbers"]["ledgers"]
            e = common.intercept_expectation(L["first"]["calls"], launch.intercept_window("intercept"), True)
            rec["stats"] = [istats(e["launches"], e["gathers"], e["launch_bytes"], e["bytes"], forwarded=5,
                                   way_in="hooked")] * 2

        def second_fails(rec):
            for res in rec["results"]:
                res["numbers"].update(second="error", second_error="DistBackendError: NCCL error")
        with tempfile.NamedTemporaryFile(suffix="libnccl.so.2") as lib:
            d = self.run_step("recreate", self.recreate_fake({"intercept": first_only, "nccl-lib": second_fails}),
                              {"ROCE_GATHER_GPU_NCCL_LIB": lib.name})
        self.assertEqual(d["status"], "warn", d["failures"])
        self.assertEqual(d["numbers"]["ref_count_needed"], {"2.28.9": "needed", "2.30.7": "needed"})
        self.assertIn("recreate.intercept: NCCL 2.28.9 needs NCCL_NET_PLUGIN_REF_COUNT=1 for a process group made after "
                      "the last one was destroyed; without it: rank 0: only the first process group's gathers took the "
                      "path (the second's went to NCCL)", d["notes"])
        self.assertTrue(any(n.startswith("recreate.nccl-lib: NCCL 2.30.7 needs") and "DistBackendError" in n
                            for n in d["notes"]), d["notes"])

    def test_recreate_failures(self):
        def off(rec):
            rec["stats"] = [istats(0, 0, 0, 0, forwarded=8, way_in="hooked")] * 2

        def wrong(rec):
            rec["results"][1]["failures"] = ["recreate/first/16B: 1 of 32 bytes differ"]
        # REF_COUNT=1 does not mend it: both fail; wrong bytes fail whatever the case.
        d = self.run_step("recreate", self.recreate_fake({"intercept": off, "intercept-refcount1": off,
                                                          "nccl-socket": wrong}), {"ROCE_GATHER_GPU_NCCL_LIB": ""})
        self.assertEqual(d["status"], "fail")
        self.assertEqual([f.split(":")[0] for f in d["failures"]],
                         ["recreate.intercept", "recreate.intercept-refcount1", "recreate.nccl-socket"])
        self.assertIn("wrong values: recreate/first/16B", d["failures"][2])
        self.assertEqual(d["numbers"]["ref_count_needed"], {"2.28.9": "unknown"})

    def test_recreate_on_the_wrong_nccl(self):
        """A pair whose ranks ran another NCCL than the one LD_PRELOAD named fails its case, whatever it observed."""
        def wrong_nccl(rec):
            rec["failures"].append("recreate.nccl-lib rank 0: NCCL 2.28.9 ran, not 2.30.7 from LD_PRELOAD=/x")
        with tempfile.NamedTemporaryFile(suffix="libnccl.so.2") as lib:
            d = self.run_step("recreate", self.recreate_fake({"nccl-lib": wrong_nccl}), {"ROCE_GATHER_GPU_NCCL_LIB": lib.name})
        self.assertEqual(d["status"], "fail")
        self.assertEqual(d["failures"], ["recreate.nccl-lib: recreate.nccl-lib rank 0: NCCL 2.28.9 ran, not 2.30.7 from "
                                         "LD_PRELOAD=/x"])
        self.assertEqual(d["numbers"]["nccl-lib-refcount1"]["status"], "ok")

    def test_report(self):
        self.run_step("latency", self.intercept_latency_fake([]), {"ROCE_GATHER_GPU_LATENCY_ROUNDS": "1"})
        self.run_step("recreate", self.recreate_fake({}), {"ROCE_GATHER_GPU_NCCL_LIB": ""})
        out = os.path.join(self.work, "out")
        argv = ["report.py", "--work", self.work, "--out", out, "--steps", "recreate latency", "--start", str(time.time())]
        with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(self.out):
            with self.assertRaises(SystemExit) as e:
                report.main()
        self.assertEqual(e.exception.code, 0)
        self.assertEqual(sorted(os.listdir(out)), ["latency.csv", "results.tar.gz", "summary.json", "summary.md"])
        md = read(os.path.join(out, "summary.md"))
        self.assertIn("CUDA MPS: not used", md)
        self.assertIn("## recreate: pass", md)
        self.assertIn("## latency: pass", md)
        s = json.loads(read(os.path.join(out, "summary.json")))
        self.assertEqual(list(s["steps"]), ["recreate", "latency"])
        self.assertEqual(s["steps"]["recreate"]["numbers"]["ref_count_needed"], {"2.28.9": "not needed"})


class CalibrateDriverTest(unittest.TestCase):
    def test_plan_and_commands(self):
        self.assertEqual(calibrate.plan(2), [(0, "nccl"), (1, "intercept"), (2, "intercept"), (3, "nccl")])
        a = mock.Mock(torchrun=["python3", "-m", "torch.distributed.run"], nnodes=2, node_rank=1, master_addr="hostA",
                      master_port=29510, sizes=[16, 4096], reps=3)
        cmd = calibrate.torchrun_command(a, 2, "intercept", "/o")
        self.assertEqual(cmd[:13], ["python3", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                    "--node-rank", "1", "--master-addr", "hostA", "--master-port", "29512"])
        self.assertEqual(cmd[cmd.index("--result") + 1], "/o/cal.2.intercept.json")
        self.assertEqual(json.loads(cmd[cmd.index("--params") + 1]), {"role": "intercept", "sizes": [16, 4096], "reps": 3,
                                                                      "cap": 4096})
        # The user's job environment, but the window opened and the stats to the run's file; for
        # NCCL's runs, no library: NCCL_NET_PLUGIN=none and the library out of LD_PRELOAD.
        user = {"NCCL_NET_PLUGIN": "/mine.so", "NCCL_NET": "IB", "ROCE_GATHER_MAX_BYTES": "64K", "NCCL_NVLS_ENABLE": "1",
                "LD_PRELOAD": "/opt/x.so:/usr/lib/libroce_gather.so", "ROCE_GATHER_STATS": "/tmp/s"}
        e = calibrate.run_env(user, "intercept", "/o/s.json", 1 << 20, "/lib.so")
        self.assertEqual((e["NCCL_NET_PLUGIN"], e["ROCE_GATHER_MAX_BYTES"], e["ROCE_GATHER_MIN_BYTES"],
                          e["ROCE_GATHER_ENABLE"], e["ROCE_GATHER_STATS"], e["NCCL_NVLS_ENABLE"], e["NCCL_NET"]),
                         ("/mine.so", "1048576", "0", "1", "/o/s.json", "0", "IB"))
        e = calibrate.run_env(user, "nccl", "/o/s.json", 1 << 20, "/lib.so")
        self.assertEqual((e["NCCL_NET_PLUGIN"], e["LD_PRELOAD"], e["NCCL_NET"]), ("none", "/opt/x.so", "IB"))
        self.assertNotIn("ROCE_GATHER_STATS", e)
        e = calibrate.run_env({"NCCL_NET_PLUGIN": "none"}, "intercept", "/o/s.json", 1 << 20, "/lib.so")
        self.assertEqual(e["NCCL_NET_PLUGIN"], "/lib.so")
        self.assertNotIn("LD_PRELOAD", calibrate.run_env({"LD_PRELOAD": "/lib.so"}, "nccl", "/s", 16, "/lib.so"))

    def test_window_from_files(self):
        with tempfile.TemporaryDirectory() as d:
            sizes = [16, 4096, 65536]
            for i, role in calibrate.plan(1):
                us = {16: 20, 4096: 30, 65536: 80} if role == "nccl" else {16: 40, 4096: 20, 65536: 50}
                led = ledger_for(sizes)
                with open(os.path.join(d, f"cal.{i}.{role}.json"), "w") as f:
                    json.dump({"completed": True, "failures": [], "ledger": led, "params": {"cap": 65536},
                               "numbers": {"samples": {"graph": samples_for(us)}}}, f)
                if role == "intercept":
                    e = common.intercept_expectation(led["calls"], (0, 65536), True)
                    with open(os.path.join(d, f"stats.{i}.{role}.json"), "w") as f:
                        json.dump(istats(e["launches"], e["gathers"], e["launch_bytes"], e["bytes"]), f)
            a = calibrate.analyse(calibrate.load_dir(d))
            self.assertEqual(a["failures"], [])
            self.assertEqual(a["env"], "export ROCE_GATHER_MIN_BYTES=4096 ROCE_GATHER_MAX_BYTES=65536")
            text = calibrate.write_answer(d, a)
            self.assertIn("export ROCE_GATHER_MIN_BYTES=4096 ROCE_GATHER_MAX_BYTES=65536", text)
            self.assertIn("| 4 KiB |", text)
            p = subprocess.run([sys.executable, os.path.join(HERE, "calibrate.py"), "window", d], capture_output=True,
                               text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("Window: 4 KiB to 64 KiB a rank", p.stdout)
            os.remove(os.path.join(d, "stats.1.intercept.json"))
            p = subprocess.run([sys.executable, os.path.join(HERE, "calibrate.py"), "window", d], capture_output=True,
                               text=True)
            self.assertEqual(p.returncode, 1)
            self.assertIn("NO ANSWER", p.stdout)
            self.assertIn("no ROCE_GATHER_STATS file", p.stdout)


# ---- bench.py against a stand-in torch ------------------------------------------------------

def fake_torch():
    """Modules torch, torch.cuda, torch.distributed standing in for PyTorch in one process:
    tensors are keys, a gather computes the key of the right output, an all-reduce of a
    pattern's key the key of op(both ranks' patterns) (others keep theirs, or become the key of
    their sum), arithmetic makes a key of its operands, a CUDA graph records the collectives,
    copies and kernels made while capturing and runs them at replay, time advances 25 µs a
    collective. `counts` says
    how many AllGathers ("enq", "exec") and AllReduces ("ar_enq", "ar_exec") were enqueued
    (eager calls and captured ones) and run."""
    import types
    counts = {"enq": 0, "exec": 0, "ar_enq": 0, "ar_exec": 0, "clock": 0}
    capturing = []

    class T:
        def __init__(self, key):
            self.key = key

        def zero_(self):
            self.key = ("zero",)
            return self

        def cpu(self):
            return self

        def tolist(self):
            return list(self.key[1])

        def copy_(self, other):
            def do():
                self.key = other.key
            later(do)
            return self

        def to(self, device):
            return self

        def fill_(self, value):
            self.key = ("fill", value)
            return self

        def clone(self):
            return T(self.key)

        def view(self, *shape):
            return self

        def numpy(self):
            return repr(self.key).encode()

        def __getitem__(self, i):
            return Part(self, i)

        def expr(op):
            return lambda self, other: T((op, self.key, getattr(other, "key", other)))
        __add__, __sub__, __mul__, __mod__, __truediv__ = expr("+"), expr("-"), expr("*"), expr("%"), expr("/")

    class Part(T):
        """A part of a tensor (t[i]): its key is the key its tensor has when it is read."""

        def __init__(self, of, i):
            self.of, self.i = of, i

        @property
        def key(self):
            return ("part", self.of.key, self.i)

    def later(fn):
        """fn now, or at each replay of the graph being captured (what a capture records runs only then)."""
        if capturing:
            capturing[-1].calls.append(fn)
        else:
            fn()

    torch = types.ModuleType("torch")
    torch.FakeTensor = T
    cuda = types.ModuleType("torch.cuda")
    dist = types.ModuleType("torch.distributed")
    for name in ("int8", "int32", "int64", "float64", "float32", "float16", "bfloat16", "uint8"):
        setattr(torch, name, name)
    torch.device = lambda *a: ("device",) + a
    torch.tensor = lambda vals, dtype=None, device=None: T(("vals", tuple(vals)))
    torch.zeros = lambda *a, **k: T(("zeros",))
    torch.empty = lambda *a, **k: T(("empty",))
    torch.full = lambda size, value, **k: T(("full", value))
    torch.arange = lambda n, **k: T(("arange", n))
    torch.cat = lambda ts: T(("cat",) + tuple(t.key for t in ts))
    torch.maximum = lambda a, b: T(("max", a.key, b.key))
    torch.equal = lambda a, b: a.key == b.key

    def mul(a, b, out):
        later(lambda: setattr(out, "key", ("*", a.key, b.key)))
    torch.mul = mul

    def index_select(t, dim, idx, out):
        later(lambda: setattr(out, "key", ("index", t.key)))
    torch.index_select = index_select

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = counts["clock"]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 0.025

    class CUDAGraph:
        def __init__(self):
            self.calls = []

        def replay(self):
            for f in self.calls:
                f()

    @contextlib.contextmanager
    def graph(g, capture_error_mode=None):
        capturing.append(g)
        yield
        capturing.pop()
    cuda.Event, cuda.CUDAGraph, cuda.graph, cuda.synchronize = Event, CUDAGraph, graph, lambda: None
    torch.cuda = cuda

    def run(out, inp):
        if inp.key[0] == "pattern":
            _, rank, n, salt = inp.key
            out.key = ("cat", ("pattern", 0, n, salt), ("pattern", 1, n, salt))
        else:
            out.key = ("gathered", inp.key)
        counts["exec"] += 1
        counts["clock"] += 1

    def all_gather_into_tensor(out, inp):
        counts["enq"] += 1
        if capturing:
            capturing[-1].calls.append(lambda: run(out, inp))
        else:
            run(out, inp)

    def run_ar(t, op):
        if t.key[0] == "pattern":
            _, _, n, salt = t.key
            t.key = (op, ("pattern", 0, n, salt), ("pattern", 1, n, salt))
        elif t.key[0] not in ("vals", "zeros", op):  # agree_max's and sync_peers' tensors keep theirs
            t.key = (op, t.key)
        counts["ar_exec"] += 1
        counts["clock"] += 1

    def all_reduce(t, op="sum"):
        counts["ar_enq"] += 1
        if capturing:
            capturing[-1].calls.append(lambda: run_ar(t, op))
        else:
            run_ar(t, op)
    dist.all_gather_into_tensor = all_gather_into_tensor
    dist.all_reduce = all_reduce
    dist.ReduceOp = types.SimpleNamespace(MAX="max", SUM="sum")
    torch.distributed = dist
    return {"torch": torch, "torch.cuda": cuda, "torch.distributed": dist}, counts


class BenchTest(unittest.TestCase):
    def run_task(self, params, task="latency"):
        mods, counts = fake_torch()
        with mock.patch.dict(sys.modules, mods), tempfile.TemporaryDirectory() as d:
            for m in ("bench", "torch_cases"):
                sys.modules.pop(m, None)
            import bench
            import torch_cases
            T = mods["torch"].FakeTensor
            with mock.patch.object(bench, "pattern", lambda rank, numel, salt, dev: T(("pattern", rank, numel, salt))):
                args = mock.Mock(rank=0, local=0, params=params, result=os.path.join(d, "r.json"), task=task)
                res = common.Result(args)
                ctx = torch_cases.Ctx(args, res)
                with contextlib.redirect_stdout(io.StringIO()):
                    (bench.task_latency if task == "latency" else calibrate.task_calibrate)(ctx)
                written = json.loads(read(args.result))
            for m in ("bench", "torch_cases"):
                sys.modules.pop(m, None)
        return ctx, res, counts, written

    def test_ledger_matches_what_ran(self):
        ctx, res, counts, written = self.run_task({"sizes": [16, 4096, 1 << 20], "modes": ["graph", "eager"], "reps": 3,
                                                   "target_ms": 10, "budget_s": 60})
        calls = ctx.ledger.n["calls"]
        self.assertEqual(res.d["n_failures"], 0, res.d["failures"])
        self.assertEqual(sorted(calls), ["1048576", "16", "4096"])
        # What the interceptor sees: every call made (eager, the agreement's among them, and captured),
        # and every gather run.
        self.assertEqual(sum(r["eager"] + r["captured"] for r in calls.values()), counts["enq"])
        self.assertEqual(sum(r["eager"] + r["replays"] for r in calls.values()), counts["exec"])
        self.assertEqual(sum(r["first"] for r in calls.values()), 1)  # the first call made the agreement
        n = res.d["numbers"]
        self.assertEqual(n["reps_done"], 3)
        self.assertTrue(n["agreed"])
        self.assertEqual(len(n["samples"]["graph"]["4096"]), 3)
        self.assertAlmostEqual(n["samples"]["graph"]["4096"][0], 25.0)  # the stand-in's 25 µs a gather
        self.assertEqual(n["replays"]["16"], 100)  # 10 ms of 4 gathers at 25 µs
        self.assertEqual(written["numbers"]["reps_done"], 3)  # rewritten after every round

    def test_budget_stops_after_first_round(self):
        ctx, res, counts, _ = self.run_task({"sizes": [16], "modes": ["graph"], "reps": 5, "budget_s": 0})
        self.assertEqual(res.d["numbers"]["reps_done"], 1)
        self.assertIn("budget", res.d["numbers"]["stopped"])
        row = ctx.ledger.n["calls"]["16"]
        self.assertEqual(row["eager"] + row["replays"], counts["exec"])

    def test_calibrate_defaults(self):
        ctx, res, counts, _ = self.run_task({"role": "intercept", "sizes": [16, 1 << 20], "reps": 1}, task="calibrate")
        self.assertEqual(ctx.params["cap"], 1 << 20)  # the window opened to the largest size, which analyse judges by
        self.assertEqual(list(res.d["numbers"]["samples"]), ["graph"])
        self.assertEqual(sorted(ctx.ledger.n["calls"]), ["1048576", "16"])


class MatrixGroupsTest(unittest.TestCase):
    """task_matrix's second group and re-made default group (torch_cases.py, against the stand-in
    torch): which communicator each gather goes to, and that the ledger sees each one's agreement."""

    def test_groups_and_default_again(self):
        mods, _ = fake_torch()
        done = []
        with mock.patch.dict(sys.modules, mods):
            sys.modules.pop("torch_cases", None)
            import torch_cases
            dist = mods["torch.distributed"]
            dist.new_group = lambda ranks: done.append(("new_group", tuple(ranks))) or "G2"
            dist.destroy_process_group = lambda g=None: done.append(("destroy", g))
            import types
            dtypes = {n: types.SimpleNamespace(itemsize=k) for n, k in (("float32", 4), ("bfloat16", 2), ("int32", 4),
                                                                       ("uint8", 1))}
            size = lambda sh: sh["n"] * getattr(sh["dt"], "itemsize", 1)  # torch.uint8 is a name in the stand-in

            def into(ctx, name, shards, in_off=0, out_off=0):
                done.append(("into", name, ctx.comm, ctx.group))
                ctx.ledger.gather(size(shards[0]), comm=ctx.comm)

            def listform(ctx, name, shards):
                done.append(("list", name, ctx.comm, ctx.group))
                ctx.ledger.gather(size(shards[0]), listform=True, comm=ctx.comm)
            args = mock.Mock(rank=1, local=0, params={"extra_shards": [1048592], "groups": True, "port2": 4242})
            ctx = torch_cases.Ctx(args, mock.Mock())
            with mock.patch.object(torch_cases, "gather_into", into), mock.patch.object(torch_cases, "gather_list", listform), \
                    mock.patch.object(torch_cases, "gen", lambda name, r, n, dt: {"n": n, "dt": dt}), \
                    mock.patch.dict(torch_cases.DTYPES, dtypes), \
                    mock.patch.object(torch_cases, "init_group", lambda a, port: done.append(("init", port))):
                torch_cases.task_matrix(ctx)
            sys.modules.pop("torch_cases", None)
        ops = [d[0] for d in done if d[0] not in ("into", "list")]
        self.assertEqual(ops, ["new_group", "destroy", "destroy", "init"])
        self.assertEqual([d for d in done if d[0] in ("destroy", "init")], [("destroy", "G2"), ("destroy", None), ("init", 4242)])
        g2 = [d for d in done if d[0] in ("into", "list") and d[1].startswith("group2/")]
        self.assertEqual(g2[0][:3], ("into", "group2/into/uint8/16B", "group2"))
        self.assertEqual(g2[1][1:4], ("group2/default-between/uint8/4096B", "default", None))
        self.assertTrue(all(d[3] == "G2" for d in g2 if d[2] == "group2"))
        again = [d for d in done if d[0] in ("into", "list") and d[1].startswith("default2/")]
        self.assertEqual(again[0][:3], ("into", "default2/into/uint8/16B", "default#2"))
        self.assertEqual({d[2] for d in again}, {"default#2"})
        calls = ctx.ledger.n["calls"]
        self.assertEqual(sum(r["first"] for r in calls.values()), 3)  # three communicators, three agreements
        self.assertEqual(calls["1048592"]["list"], 4 * 3 + 2)  # the extra shard: matrix (4 dtypes x 3 seeds), group2, default2
        self.assertEqual(calls["16"]["first"], 3)


# ---- pynccl_cases.py: the binding and what its cases ask for ------------------------------

# A NCCL with the binding's thirteen functions (and nothing it would call), each recording its
# name when called.
STANDIN_BINDING_NCCL = r"""
#include <stdio.h>
#define F(name) int name(void) { FILE* f = fopen(getenv_path(), "a"); if (f) { fputs(#name "\n", f); fclose(f); } return 0; }
#include <stdlib.h>
static const char* getenv_path(void) { const char* p = getenv("CALLS"); return p ? p : "/dev/null"; }
F(ncclGetErrorString) F(ncclGetVersion) F(ncclGetUniqueId) F(ncclCommInitRank) F(ncclAllReduce) F(ncclAllGather)
F(ncclReduceScatter) F(ncclSend) F(ncclRecv) F(ncclBroadcast) F(ncclCommDestroy) F(ncclGroupStart) F(ncclGroupEnd)
"""


def import_pynccl_cases(mods):
    """pynccl_cases imported against the stand-in torch (fake_torch)."""
    with mock.patch.dict(sys.modules, mods):
        sys.modules.pop("pynccl_cases", None)
        import pynccl_cases
        sys.modules.pop("pynccl_cases", None)
    return pynccl_cases


class PyncclCasesTest(unittest.TestCase):
    """The step's worker without a GPU: its binding takes every function of its table, in
    order, from the library when it is made, and calls none; its cases issue plain, grouped and
    captured gathers, and its ledger says exactly that."""

    def test_table_is_pynccls_and_taken_up_front(self):
        pc = import_pynccl_cases(fake_torch()[0])
        self.assertEqual([f[0] for f in pc.FUNCTIONS],
                         ["ncclGetErrorString", "ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce",
                          "ncclAllGather", "ncclReduceScatter", "ncclSend", "ncclRecv", "ncclBroadcast",
                          "ncclCommDestroy", "ncclGroupStart", "ncclGroupEnd"])
        if not shutil.which("gcc"):
            self.skipTest("needs gcc")
        with tempfile.TemporaryDirectory() as d:
            src, so, calls = os.path.join(d, "n.c"), os.path.join(d, "libnccl.so.2"), os.path.join(d, "calls")
            with open(src, "w") as f:
                f.write(STANDIN_BINDING_NCCL)
            subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-o", so, src], check=True)
            with mock.patch.dict(os.environ, {"CALLS": calls}):
                b = pc.Binding(so)
                self.assertEqual(list(b.f), [f[0] for f in pc.FUNCTIONS])
                self.assertFalse(os.path.exists(calls), "making the binding calls nothing")
                b.f["ncclGroupStart"]()
            self.assertEqual(read(calls), "ncclGroupStart\n")

    def test_cases_and_their_ledger(self):
        mods, _ = fake_torch()
        torch = mods["torch"]
        T = torch.FakeTensor
        issued, captured = [], []
        state = {"capturing": False, "group": 0}

        class Graph:
            def replay(self):
                for call in captured:
                    issued.append(("replay",) + call)

        @contextlib.contextmanager
        def graph(g, capture_error_mode=None):
            state["capturing"] = True
            yield
            state["capturing"] = False
        torch.cuda.CUDAGraph, torch.cuda.graph = Graph, graph
        torch.full = lambda *a, **k: T(("full",))
        torch.zeros = lambda n, **k: T(("zeros", None, n))  # a captured input: its size is what the case needs
        torch.cuda.current_stream = lambda: mock.Mock(cuda_stream=0x57)
        pc = import_pynccl_cases(mods)

        def gather(self, out, inp, stream=None):
            call = (inp.key[2], state["group"])
            if state["capturing"]:
                captured.append(call)
            else:
                issued.append(("eager",) + call)
        nccl = mock.Mock()
        nccl.f = {"ncclGroupStart": lambda: state.__setitem__("group", state["group"] + 1) or 0,
                  "ncclGroupEnd": lambda: state.__setitem__("group", state["group"] - 1) or 0}
        nccl.check = lambda what, r: None
        args = mock.Mock(rank=1, local=0)
        res = mock.Mock()
        res.d = {"cases": 0}
        with mock.patch.dict(sys.modules, mods), mock.patch.object(pc.Cases, "gather", gather), \
                mock.patch.object(pc.Cases, "verify", lambda self, name, out, shards: None), \
                mock.patch.object(pc, "gen", lambda tag, r, n: T(("gen", r, n, tag))):
            cases = pc.Cases(args, res, nccl, "comm")
            cases.ledger = common.Ledger()
            cases.run([16, 4096], 3)
        self.assertEqual(issued[:4], [("eager", 16, 0), ("eager", 4096, 0), ("eager", 16, 1), ("eager", 4096, 1)])
        self.assertEqual(captured, [(16, 0), (4096, 0)])
        self.assertEqual(issued[4:], [("replay", 16, 0), ("replay", 4096, 0)] * 3)
        c = cases.ledger.n["calls"]
        self.assertEqual(c["16"], dict(first=1, eager=2, captured=1, list=0, replays=3, pre=0, replays_pre=0))  # eager: the first too
        self.assertEqual(c["4096"], dict(first=0, eager=2, captured=1, list=0, replays=3, pre=0, replays_pre=0))
        self.assertEqual(cases.ledger.agreed, {"default"})  # the first eager call agreed, once


@unittest.skipUnless(subprocess.run(["/usr/bin/python3", "-c", "import matplotlib"], capture_output=True).returncode == 0
                     if os.path.exists("/usr/bin/python3") else False, "needs a python3 with matplotlib")
class PlotTest(unittest.TestCase):
    def test_graph_only_and_unstyled_configs(self):
        with tempfile.TemporaryDirectory() as d:
            src, png = os.path.join(d, "l.csv"), os.path.join(d, "l.png")
            measure.write_csv(src, ["config", "mode", "bytes_per_rank", "round", "rep", "us_per_gather"],
                              [[c, "graph", b, 0, i, str(10 + b / 1024 + i)] for c in ("intercept", "nccl-socket", "x-new")
                               for b in (16, 4096, 4 << 20) for i in range(3)])
            p = subprocess.run(["/usr/bin/python3", os.path.join(HERE, "plot.py"), src, png], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertGreater(os.path.getsize(png), 10000)


# ---- run_all.sh ------------------------------------------------------------------------------

@unittest.skipUnless(shutil.which("bash") and shutil.which("timeout"), "needs bash and timeout")
class RunAllTest(unittest.TestCase):
    """run_all.sh with one step that needs no GPU (plot, which skips without latency.csv), on
    one "GPU": MPS is started before the steps and stopped after them, the summary says so."""

    def test_mps_lifecycle(self):
        fake = FakeNvidia()
        if not fake.has_cuda:
            fake.close()
            self.skipTest("needs gcc for the stand-in libcuda")
        out, tmp = tempfile.mkdtemp(), tempfile.mkdtemp()
        try:
            env = dict(os.environ, ROCE_GATHER_GPU_ONE_DEVICE="0", ROCE_GATHER_GPU_STEPS="plot", TMPDIR=tmp,
                       PATH=fake.bin + os.pathsep + os.environ["PATH"],
                       LD_LIBRARY_PATH=fake.lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
            env.pop("OUT", None)
            p = subprocess.run(["bash", os.path.join(HERE, "run_all.sh"), out], capture_output=True, text=True, env=env,
                               timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("CUDA MPS: started", p.stdout)
            work = next(os.path.join(tmp, d) for d in os.listdir(tmp) if d.startswith("roce_gather_gpu."))
            self.assertEqual(live_fake_pids(work), [])  # stopped at the end
            s = json.loads(read(os.path.join(out, "summary.json")))
            self.assertTrue(s["mps"]["used"])
            self.assertIn("CUDA MPS: ran", read(os.path.join(out, "summary.md")))
            calls = read(os.path.join(work, "mps", "log", "calls"))
            self.assertIn("-d", calls)
            self.assertTrue(os.path.isdir(os.path.join(work, "mps", "pipe")))
        finally:
            for d in os.listdir(tmp):
                for pid in live_fake_pids(os.path.join(tmp, d)):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(out)
            shutil.rmtree(tmp)
            fake.close()

    def test_groups(self):
        out, tmp = tempfile.mkdtemp(), tempfile.mkdtemp()
        try:
            env = dict(os.environ, ROCE_GATHER_GPU_STEPS="plot timing", TMPDIR=tmp, ROCE_GATHER_GPU_BUDGET_S="10")
            env.pop("ROCE_GATHER_GPU_ONE_DEVICE", None)
            run = lambda: subprocess.run(["bash", os.path.join(HERE, "run_all.sh"), out], capture_output=True, text=True,
                                         env=env, timeout=120)
            p = run()
            self.assertIn("steps: env arlatency decode calibrate latency plot \n", p.stdout)
            s = json.loads(read(os.path.join(out, "summary.json")))
            self.assertEqual(list(s["steps"]), ["env", "arlatency", "decode", "calibrate", "latency", "plot"])  # in order
            self.assertNotEqual(p.returncode, 0)  # every step skipped: the budget of 10 s is below 15
            env.pop("ROCE_GATHER_GPU_STEPS")  # the default group
            p = run()
            self.assertIn("steps: env gather graphs capi jax pynccl abort integrity recreate allreduce latency plot \n",
                          p.stdout)
            s = json.loads(read(os.path.join(out, "summary.json")))
            # Run in the plan's order: latency, which fits its rounds into what is left, last but plot.
            self.assertEqual(list(s["steps"]), ["env", "gather", "graphs", "capi", "jax", "pynccl", "abort", "integrity",
                                                "recreate", "allreduce", "latency", "plot"])
            # A name that is neither a step nor a group: nothing runs, and the run says why.
            os.remove(os.path.join(out, "summary.json"))
            env["ROCE_GATHER_GPU_STEPS"] = "gather intercept"
            p = run()
            self.assertEqual(p.returncode, 2)
            self.assertIn("ROCE_GATHER_GPU_STEPS names 'intercept': neither a step", p.stderr)
            self.assertFalse(os.path.exists(os.path.join(out, "summary.json")))
        finally:
            shutil.rmtree(out)
            shutil.rmtree(tmp)


# ---- integrity ------------------------------------------------------------------------------

def icall(tag, n, states=("exact", "exact")):
    """A worker's record of one call whose rows are as states say (foreign: another call's)."""
    rows = []
    for r, st in enumerate(states):
        b = {"exact": integrity.tag_bytes(r, tag, n), "untouched": bytes([integrity.POISON]) * n,
             "foreign": integrity.tag_bytes(r, tag + 1, n)}[st]
        rows.append(integrity.classify(b, r, tag, n))
    return {"tag": tag, "bytes": n, "rows": rows}


def iwarn(peer, cause):
    return (f"vm:1:2 [roce_gather] NCCL WARN NET/roce_gather : one-shot gather of communicator 0x55d1 with rank {peer} "
            f"(127.0.0.1:4242) failed at sequence 2: {cause}\n")


def imismatch(rank, b0, c0, b1, c1, calls=(2, 2)):
    def ann(n, c, call):
        return f"sequence 2, call {call}: an all-gather of {n} bytes a rank in {c} chunk{'s' if c > 1 else ''} of 262144 bytes"
    this = ["announced", "announced"]
    this[rank] = "(this rank) has"
    return iwarn(1 - rank, f"the ranks' calls differ: rank 0 {this[0]} {ann(b0, c0, calls[0])}; rank 1 {this[1]} "
                           f"{ann(b1, c1, calls[1])}; no row is written")


def icall_of(call, tag, n, state):
    """A worker's record of a mismatch case's call: a gather's two rows, or an all-reduce's buffer
    (untouched: its input as it was, written: anything else)."""
    if call["coll"] == "gather":
        return icall(tag, n, (state, state))
    own = integrity.tag_bytes(0, tag, n)
    buf = own if state == "untouched" else bytes(n)
    return {"tag": tag, "bytes": n, "collective": "allreduce", "rows": [integrity.classify_allreduce(buf, own)]}


def iann(call, n):
    """How a WARN might announce a call (the library's words are its own; the step matches loosely)."""
    if call["coll"] == "gather":
        return f"an all-gather of {n} bytes a rank ({call['dtype']}) in 1 chunk of 262144 bytes"
    return f"an all-reduce of {n} bytes ({call['op']}, {call['dtype']}) in 1 chunk of 262144 bytes"


def integrity_good():
    """Both ranks' records and each case's part of their logs, as the library must leave them."""
    res, logs = [{}, {}], [{}, {}]
    probe = "DistBackendError: NCCL error: invalid usage"
    for case, spec in integrity.CASES.items():
        n = spec["bytes"][0]
        logs[0][case] = logs[1][case] = ""
        if spec["kind"] == "differ":
            for r in (0, 1):
                res[r][case] = {"calls": [icall(2, spec["bytes"][r], ("untouched", "untouched"))], "probe_error": probe}
                logs[r][case] += imismatch(r, spec["bytes"][0], spec["chunks"][0], spec["bytes"][1], spec["chunks"][1])
        elif spec["kind"] == "reorder":
            for r in (0, 1):
                res[r][case] = {"calls": [icall(2, n, ("untouched",) * 2), icall(3, n, ("untouched",) * 2)], "probe_error": probe}
                logs[r][case] += imismatch(r, n, 1, n, 1, calls=(3, 4))
        elif spec["kind"] == "mismatch":
            for r in (0, 1):
                res[r][case] = {"calls": [icall_of(spec["calls"][r], 2, n, "untouched")], "probe_error": probe}
                logs[r][case] += iwarn(1 - r, "the ranks' calls differ: rank 0 announced sequence 2, call 2: "
                                       + iann(spec["calls"][0], n) + "; rank 1 announced sequence 2, call 2: "
                                       + iann(spec["calls"][1], n) + "; no output is written")
        elif spec["kind"] == "overlap":
            res[0][case] = {"calls": [icall(2, n, ("untouched",) * 2), icall(3, n, ("untouched",) * 2)], "probe_error": probe}
            res[1][case] = {"calls": [icall(2, n), icall(3, n, ("untouched",) * 2)], "probe_error": probe}
            logs[0][case] += iwarn(1, "two launches of this communicator's one-shot calls ran on the device at once (a CUDA graph ...")
            logs[1][case] += iwarn(0, "the peer stopped: the one-shot path of rank 0 (127.0.0.1:4242) failed after sequence 2 (its own "
                                "WARN says why)")
        else:
            q = spec["queued"]
            res[0][case] = {"calls": [icall(2 + i, n, ("untouched",) * 2) for i in range(q)], "probe_error": None}
            res[1][case] = {"calls": [icall(2, n)] + [icall(3 + i, n, ("untouched",) * 2) for i in range(q - 1)],
                            "probe_error": probe}
            logs[1][case] += iwarn(0, "the peer stopped: rank 0 (127.0.0.1:4242) aborted its communicator (ncclCommAbort) after "
                                "sequence 2")
    return res, logs


class IntegrityTest(unittest.TestCase):
    def test_classify(self):
        self.assertEqual(integrity.classify(integrity.tag_bytes(1, 7, 100), 1, 7, 100), {"state": "exact"})
        self.assertEqual(integrity.classify(b"\xee" * 100, 1, 7, 100), {"state": "untouched"})
        # Another call's unit, a partial last unit, the other rank's shard: each named.
        self.assertEqual(integrity.classify(integrity.tag_bytes(1, 8, 100), 1, 7, 100),
                         {"state": "foreign", "unit": 0, "found": "rank 1's unit 0 of call 8", "want": "rank 1's unit 0 of call 7"})
        b = bytearray(integrity.tag_bytes(0, 7, 100))
        b[99] ^= 1
        st = integrity.classify(bytes(b), 0, 7, 100)
        self.assertEqual((st["state"], st["unit"]), ("foreign", 6))
        st = integrity.classify(integrity.tag_bytes(0, 7, 64), 1, 7, 64)
        self.assertEqual(st["found"], "rank 0's unit 0 of call 7")
        half = integrity.tag_bytes(0, 7, 32) + b"\xee" * 32  # one row written, the other not
        self.assertEqual(integrity.call_state({"rows": [integrity.classify(half[:32], 0, 7, 32),
                                                        integrity.classify(half[32:], 1, 7, 32)]}), "foreign")

    def test_every_case_passes_as_the_library_must_leave_it(self):
        res, logs = integrity_good()
        for case in integrity.ORDER:
            self.assertEqual(integrity.verdict(case, [res[0][case], res[1][case]], [logs[0][case], logs[1][case]]), [], case)
        # The overlap's peer may fail on the mismatch of the replay's call number instead.
        logs[1]["overlap"] = logs[1]["overlap"].replace("the peer stopped: the one-shot path of rank 0 (127.0.0.1:4242) failed after sequence 2 "
                                  "(its own WARN says why)", "the ranks' calls differ: rank 0 announced sequence 2, call 3: an "
                                  "all-gather of 4096 bytes a rank in 1 chunk of 262144 bytes; rank 1 (this rank) has sequence 2, "
                                  "call 4: x")
        self.assertEqual(integrity.verdict("overlap", [res[0]["overlap"], res[1]["overlap"]],
                                           [logs[0]["overlap"], logs[1]["overlap"]]), [])

    def test_foreign_bytes_fail_whatever_the_case(self):
        res, logs = integrity_good()
        res[1]["abort"]["calls"][2] = icall(4, 4096, ("exact", "foreign"))
        F = integrity.verdict("abort", [res[0]["abort"], res[1]["abort"]], [logs[0]["abort"], logs[1]["abort"]])
        self.assertEqual(F, ["abort: rank 1, call 4: a row holds bytes that are not the call's (unit 0 is rank 1's unit 0 of "
                             "call 5, not rank 1's unit 0 of call 4): exact, foreign"])

    def test_success_where_the_case_must_fail(self):
        res, logs = integrity_good()
        res[0]["differ-size"]["calls"][0] = icall(2, 4096)
        res[1]["differ-size"]["probe_error"] = None
        F = integrity.verdict("differ-size", [res[0]["differ-size"], res[1]["differ-size"]],
                              [logs[0]["differ-size"], logs[1]["differ-size"]])
        self.assertEqual(F, ["differ-size: rank 0, call 2: exact, expected untouched (the ranks' sizes differ)",
                             "differ-size: rank 1's next gather on the communicator returned, though the case failed it"])
        res, logs = integrity_good()
        res[1]["abort"]["calls"][1] = icall(3, 4096)  # rank 1's second gather succeeded after rank 0 aborted
        F = integrity.verdict("abort", [res[0]["abort"], res[1]["abort"]], [logs[0]["abort"], logs[1]["abort"]])
        self.assertEqual(F, ["abort: rank 1, call 3: exact, expected untouched (rank 0 aborted before it)"])

    def test_warns_are_required(self):
        res, logs = integrity_good()
        F = integrity.verdict("differ-chunks", [res[0]["differ-chunks"], res[1]["differ-chunks"]], ["", logs[1]["differ-chunks"]])
        self.assertEqual(len(F), 1)
        self.assertIn("differ-chunks: rank 0's log has no WARN naming both ranks' calls", F[0])
        # The WARN of another case's sizes is not this case's.
        F = integrity.verdict("differ-size", [res[0]["differ-size"], res[1]["differ-size"]],
                              [imismatch(0, 4096, 1, 4096, 1), logs[1]["differ-size"]])
        self.assertEqual(len(F), 1, F)
        F = integrity.verdict("reorder", [res[0]["reorder"], res[1]["reorder"]],
                              [imismatch(0, 4096, 1, 4096, 1, calls=(3, 3)), logs[1]["reorder"]])
        self.assertEqual(F, ["reorder: rank 0's WARN names call 3 on both ranks, which are not the same call"])
        F = integrity.verdict("abort", [res[0]["abort"], res[1]["abort"]], [logs[0]["abort"], ""])
        self.assertIn("abort: rank 1's log has no WARN naming rank 0's abort", F[0])

    def test_mismatched_calls(self):
        """Calls of the same bytes that differ in collective, op or datatype: untouched on both ranks
        (an all-reduce's buffer its input as it was), each rank's WARN, the next call raising."""
        self.assertEqual([c for c in integrity.ORDER if integrity.CASES[c]["kind"] == "mismatch"],
                         ["allreduce-vs-gather", "allreduce-vs-gather-chunks", "allreduce-op", "allreduce-dtype",
                          "allreduce-dtype-half"])
        self.assertEqual(integrity.ORDER[-1], "abort")  # it aborts a communicator: last
        for case in ("allreduce-vs-gather", "allreduce-vs-gather-chunks"):
            self.assertEqual({c["coll"] for c in integrity.CASES[case]["calls"]}, {"gather", "allreduce"})
        for case, key in (("allreduce-op", "op"), ("allreduce-dtype", "dtype"), ("allreduce-dtype-half", "dtype")):
            a, b = integrity.CASES[case]["calls"]
            self.assertNotEqual(a[key], b[key])
            sizes = {arcases.DTYPES[x["dtype"]]["size"] for x in (a, b)}
            self.assertEqual(len(sizes), 1, "the same bytes: datatypes of one size")
        res, logs = integrity_good()
        v = lambda case: integrity.verdict(case, [res[0][case], res[1][case]], [logs[0][case], logs[1][case]])
        self.assertEqual(v("allreduce-op"), [])
        # The all-reduce wrote its buffer although the peer's call differs: a failure naming it.
        res[1]["allreduce-op"]["calls"][0] = icall_of(integrity.CASES["allreduce-op"]["calls"][1], 2, 4096, "written")
        self.assertEqual(v("allreduce-op"), ["allreduce-op: rank 1, call 2: written, expected untouched (the ranks' "
                                             "calls differ, so no output is written)"])
        # Had the gathering rank taken the peer's buffer as a gather's row (it is the peer's own
        # tagged shard, so the row reads exact), the case fails all the same.
        res[0]["allreduce-vs-gather"]["calls"][0] = icall(2, 4096)
        self.assertEqual(v("allreduce-vs-gather"), ["allreduce-vs-gather: rank 0, call 2: exact, expected untouched (the "
                                                    "ranks' calls differ, so no output is written)"])
        # No WARN, or a WARN about something else: a failure.
        logs[0]["allreduce-dtype"] = iwarn(1, "the peer stopped: rank 1 (x) failed after sequence 2")
        F = v("allreduce-dtype")
        self.assertEqual(len(F), 1)
        self.assertIn("allreduce-dtype: rank 0's log has no WARN that the ranks' calls differ", F[0])
        logs[0]["allreduce-dtype"] = iwarn(1, "the ranks' calls MISMATCH in their datatype")
        self.assertEqual(v("allreduce-dtype"), [])  # matched loosely
        res[1]["allreduce-dtype-half"]["probe_error"] = None
        self.assertEqual(v("allreduce-dtype-half"), ["allreduce-dtype-half: rank 1's next gather on the communicator "
                                                     "returned, though the case failed it"])

    def test_case_logs(self):
        text = "start\nrank 1: case differ-size\nA\nrank 1: case overlap\nB\nC\n"
        self.assertEqual(integrity.case_logs(text), {"differ-size": "\nA\n", "overlap": "\nB\nC\n"})
        # A line another thread wrote right after a mark, before its newline, leaves the mark found.
        glued = "rank 1: case differ-size\nA\nrank 1: case abort[rank1]:[E1203 x] Stack trace\nWARN y\n"
        self.assertEqual(integrity.case_logs(glued), {"differ-size": "\nA\n", "abort": "[rank1]:[E1203 x] Stack trace\nWARN y\n"})

    def test_step(self):
        res, logs = integrity_good()
        work = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, work)
        os.makedirs(os.path.join(work, "logs"))
        os.makedirs(os.path.join(work, "steps"))
        calls = []

        def fake(work_, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((run, config, worker, params, extra_env, kw))
            paths = []
            for r in (0, 1):
                p = os.path.join(work, "logs", f"{run}.rank{r}.log")
                with open(p, "w") as f:  # the worker's marks, and each case's WARNs after its own
                    f.write("".join(f"rank {r}: case {c}\n{logs[r][c]}" for c in integrity.ORDER))
                paths.append(p)
            results = [{"completed": True, "failures": [], "n_failures": 0, "cases": 6, "numbers": {"cases": res[r]},
                        "ledger": None} for r in (0, 1)]
            return {"run": run, "config": config, "seconds": 20.0, "rcs": [0, 0], "limit": 90, "exit_times": [0, 0],
                    "timed_out": False, "cut_short": False, "results": results, "stats": [None, None], "logs": paths,
                    "failures": [], "notes": [], "tails": [], "nccl": ["2.28.9"] * 2, "nccl_lib": None, "mps_restart": None}
        out = io.StringIO()

        def step():
            s = steps.Step("integrity", work, time.time() + 600)
            with mock.patch.object(launch, "run_pair", side_effect=fake), contextlib.redirect_stdout(out):
                steps.step_integrity(s)
            return s.finish()
        d = step()
        self.assertEqual(d["status"], "pass", d["failures"])
        n = len(integrity.ORDER)
        self.assertEqual(d["headline"], f"{n}/{n} cases as required; calls whose rows held bytes not theirs: 0")
        run, config, worker, params, env, kw = calls[0]
        self.assertEqual((run, config, worker, params["cases"]), ("integrity", "intercept-wide", "integrity_cases.py",
                                                                   integrity.ORDER))
        self.assertEqual(env["ROCE_GATHER_TIMEOUT_MS"], "3000")
        self.assertFalse(kw["check_stats"])
        self.assertIn("| overlap | overlap | call 2 untouched; call 3 untouched | call 2 exact; call 3 untouched |", d["md"][0])
        self.assertIn("| allreduce-op | mismatch | call 2 untouched | call 2 untouched | raised | raised | pass |", d["md"][0])
        # Each mismatch case's WARN on each rank, quoted.
        warns = d["numbers"]["mismatch_warns"]
        self.assertEqual(len(warns), 2 * 5)
        self.assertTrue(warns[0].startswith("allreduce-vs-gather rank 0: vm:1:2 [roce_gather] NCCL WARN NET/roce_gather : "
                                            "one-shot gather of communicator"), warns[0])
        self.assertIn("the ranks' calls differ: rank 0 announced sequence 2, call 2: an all-gather of 4096 bytes", warns[0])
        self.assertTrue(any("allreduce-dtype-half rank 1" in m for m in d["md"][1].splitlines()), d["md"][1])
        res[0]["reorder"]["calls"][1] = icall(3, 4096, ("foreign", "foreign"))
        d = step()
        self.assertEqual(d["status"], "fail")
        self.assertEqual(d["headline"], f"{n - 1}/{n} cases as required; calls whose rows held bytes not theirs: 1")


# ---- every script: no name used that nothing defines ------------------------------------------

def undefined_globals(path):
    """The names a module's functions read as globals that the module neither defines nor imports
    and that are not builtins: each one a NameError the first time that line runs on the testbed."""
    import ast
    import builtins
    import symtable
    src = read(path)
    tree = ast.parse(src, path)
    defined = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return []  # a star import could define anything
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)  # module level, or a global statement's target
    missing = []

    def walk(t):
        for sym in t.get_symbols():
            if t.get_type() != "module" and sym.is_referenced() and sym.is_global() and sym.get_name() not in defined:
                missing.append(f"{os.path.basename(path)}: {t.get_name()}: {sym.get_name()}")
        for child in t.get_children():
            walk(child)
    walk(symtable.symtable(src, path, "exec"))
    return sorted(set(missing))


class NamesTest(unittest.TestCase):
    def test_every_global_a_script_reads_is_defined(self):
        scripts = sorted(f for f in os.listdir(HERE) if f.endswith(".py"))
        self.assertIn("steps.py", scripts)
        self.assertEqual([m for f in scripts for m in undefined_globals(os.path.join(HERE, f))], [])

    def test_the_check_finds_a_name_nothing_defines(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "m.py")
            with open(p, "w") as f:
                f.write("import re\nKNOWN = 1\n\ndef step(s):\n    return re.compile(KNOWN), GONE_RX\n")
            self.assertEqual(undefined_globals(p), ["m.py: step: GONE_RX"])


# ---- the all-reduce: its cases, its ledger, its stats ------------------------------------------

def float_of(bits, dtype):
    """The value of a bit pattern of dtype (struct for the IEEE types, by hand for fp8)."""
    if dtype == "float16":
        return struct.unpack("<e", struct.pack("<H", bits))[0]
    if dtype == "float32":
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    if dtype == "bfloat16":
        return struct.unpack("<f", struct.pack("<I", bits << 16))[0]
    if dtype == "float64":
        return struct.unpack("<d", struct.pack("<Q", bits))[0]
    e, m = arcases.DTYPES[dtype]["bits"]
    sign = -1.0 if bits >> (e + m) else 1.0
    exp, man = (bits >> m) & ((1 << e) - 1), bits & ((1 << m) - 1)
    bias = (1 << (e - 1)) - 1
    if exp == (1 << e) - 1 and (arcases.DTYPES[dtype]["inf"] or man == (1 << m) - 1):
        return sign * float("inf") if arcases.DTYPES[dtype]["inf"] and man == 0 else float("nan")
    if exp == 0:
        return sign * man * 2.0 ** (1 - bias - m)
    return sign * (1 + man / (1 << m)) * 2.0 ** (exp - bias)


class ArcasesTest(unittest.TestCase):
    def test_classes(self):
        self.assertEqual(len(arcases.REQUIRED), 4 * 7 + 3)
        for op in ("sum", "prod", "max", "min"):
            for d in ("float32", "float16", "bfloat16", "int8", "uint8", "int32", "int64"):
                self.assertTrue(arcases.required(arcases.cls(op, d)), (op, d))
        for d in ("float32", "float16", "bfloat16"):
            self.assertTrue(arcases.required(f"avg/{d}"))
        # float64 is NCCL's: its special values differed on the testbed.
        for c in ["avg/int8", "avg/int64", "sum/float8_e4m3fn", "max/float8_e5m2", "sum/float64", "avg/float64"]:
            self.assertFalse(arcases.required(c), c)
        self.assertEqual(arcases.split("prod/uint8"), ("prod", "uint8"))
        # NCCL's enums (nccl.h), as the binding passes them.
        self.assertEqual([arcases.DTYPES[d]["nccl"] for d in ("int8", "uint8", "int32", "int64", "float16", "float32",
                                                               "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2")],
                         [0, 1, 2, 4, 6, 7, 8, 9, 10, 11])
        self.assertEqual([arcases.OPS[o]["nccl"] for o in ("sum", "prod", "max", "min", "avg")], [0, 1, 2, 3, 4])

    def test_counts_around_the_cap(self):
        c = arcases.counts("float32", 262144)
        self.assertEqual(c["1"], 1)
        self.assertEqual([c[f"{n}el"] for n in (3, 999, 4097)], [3, 999, 4097])
        self.assertEqual((c["cap"], c["cap+1"]), (65536, 65537))
        pow2 = sorted(4 * n for k, n in c.items() if k.endswith("B"))
        self.assertEqual(pow2, [1 << k for k in range(4, 20) if 1 << k != 262144])  # 16 B .. 512 KiB, the cap as "cap"
        self.assertEqual(len(set(c.values())), len(c))  # no size twice
        f64 = arcases.counts("float64", 262144)
        self.assertEqual((f64["16B"], f64["cap"]), (2, 32768))
        i8 = arcases.counts("int8", 100000)  # a cap that is no power of two
        self.assertEqual((i8["cap"], i8["cap+1"], i8["131072B"]), (100000, 100001, 131072))
        self.assertNotIn("262144B", i8)  # the first power of two above the cap is the last

    def test_special_values(self):
        import math
        got = [float_of(b, "float16") for b in arcases.specials("float16")]
        self.assertEqual(got[:10], [0.0, -0.0, 2 ** -24, 2 ** -14 - 2 ** -24, 2 ** -14, 0.5, 1.0, -1.0, 1.5, 2.0])
        self.assertEqual(math.copysign(1, got[1]), -1.0)
        self.assertEqual(got[10:14], [65504.0, -65504.0, math.inf, -math.inf])
        self.assertTrue(all(math.isnan(x) for x in got[14:]))
        self.assertEqual(len(set(arcases.specials("float16")[14:])), 4)  # four NaNs, each its own bits
        for d in ("float32", "bfloat16", "float64"):
            v = [float_of(b, d) for b in arcases.specials(d)]
            fi = {"float32": (2 ** -149, 2 ** -126, 3.4028234663852886e38), "bfloat16": (2 ** -133, 2 ** -126, 3.3895313892515355e38),
                  "float64": (5e-324, 2.2250738585072014e-308, 1.7976931348623157e308)}[d]
            self.assertEqual((v[2], v[4], v[10]), fi, d)
            self.assertEqual(v[12], math.inf, d)
        e4 = [float_of(b, "float8_e4m3fn") for b in arcases.specials("float8_e4m3fn")]
        self.assertEqual(e4[:12], [0.0, -0.0, 2 ** -9, 7 * 2 ** -9, 2 ** -6, 0.5, 1.0, -1.0, 1.5, 2.0, 448.0, -448.0])
        self.assertEqual(arcases.specials("float8_e4m3fn")[12:], [0x7F, 0xFF])  # no infinities: its only NaNs
        e5 = [float_of(b, "float8_e5m2") for b in arcases.specials("float8_e5m2")]
        self.assertEqual(e5[10:14], [57344.0, -57344.0, math.inf, -math.inf])
        self.assertEqual(arcases.specials("int8"), [0x80, 0x81, 0xFE, 0xFF, 0, 1, 2, 0x7E, 0x7F, 0x55])
        self.assertEqual(arcases.specials("uint8")[-2:], [0x55, 0xAA])
        self.assertEqual(arcases.specials("int64")[:2], [1 << 63, (1 << 63) + 1])
        self.assertEqual([arcases.signed(b, 8) for b in arcases.specials("int8")], [-128, -127, -2, -1, 0, 1, 2, 126, 127, 85])

    def test_special_pairs_cover_every_ordered_pair(self):
        for d in ("float16", "float8_e4m3fn", "int32"):
            a, b = arcases.special_pairs(d)
            v = arcases.specials(d)
            self.assertEqual(len(a), len(v) ** 2)
            self.assertEqual(set(zip(a, b)), {(x, y) for x in v for y in v})

    def test_matrix_cases(self):
        cap = 262144
        cases = arcases.matrix_cases(cap)
        blocks = arcases.blocks(cases)
        self.assertEqual(len(blocks), len(arcases.DTYPES) * len(arcases.OPS))  # one block a class, each once
        self.assertEqual(len({b for b, _ in blocks}), len(blocks))
        self.assertEqual([b.split("/")[1] for b, _ in blocks[-10:]], ["float8_e4m3fn"] * 5 + ["float8_e5m2"] * 5)
        self.assertEqual(len({c["name"] for c in cases}), len(cases))
        by = dict(blocks)
        s32 = by["sum/float32"]
        self.assertEqual([c["count"] for c in s32 if c["form"] == "inplace" and c["data"] == "random"],
                         list(arcases.counts("float32", cap).values()))
        self.assertEqual([c["count"] for c in s32 if c["form"] == "copy"], [1, 1024, 65536])
        self.assertEqual([(c["count"], c["offset"]) for c in s32 if c["form"] == "offset"], [(1001, 1), (1001, 3)])
        self.assertFalse(any(c["form"] == "offset" for c in by["max/float32"]))
        sp = [c for c in by["min/float16"] if c["data"] == "special"]
        self.assertEqual((len(sp), sp[0]["count"], sp[0]["ref"]), (1, 18 * 18, False))
        self.assertTrue(all(c["ref"] for c in s32 if c["data"] == "random"))
        self.assertFalse(any(c["ref"] for c in by["avg/int32"]))  # NCCL divides its wrapped sum: NCCL's bytes only
        self.assertTrue(all(c["ref"] for c in by["avg/bfloat16"] if c["data"] == "random"))
        self.assertFalse(any(c["ref"] for c in by["sum/float8_e5m2"]))
        self.assertTrue(any(c["count"] * 4 > cap for c in s32))  # sizes above the cap: NCCL's, never a launch
        self.assertEqual(len(arcases.matrix_cases(cap, ["int8"], ["sum", "max"])), len(by["sum/int8"]) + len(by["max/int8"]))
        # A cap of 4 KiB: the copy form's 4 KiB is the cap, once.
        small = dict(arcases.blocks(arcases.matrix_cases(4096)))["sum/float32"]
        self.assertEqual([(c["label"], c["count"]) for c in small if c["form"] == "copy"], [("1", 1), ("cap", 1024)])

    def test_graph_and_binding_cases(self):
        cap = 262144
        g = arcases.graph_cases(cap)
        self.assertTrue(all(arcases.required(arcases.cls(op, d)) for op, d, _ in g))
        self.assertTrue(all(arcases.ref_holds(op, d, "random") for op, d, _ in g))
        b = [n * arcases.DTYPES[d]["size"] for _, d, n in g]
        self.assertEqual((b[0], min(b), max(b) > cap, cap in b), (16, 16, True, True))
        p = arcases.pynccl_cases(cap)
        self.assertEqual([n * 2 for op, d, n in p if (op, d) == ("sum", "bfloat16")], [16, 100, 8192, 65536, cap, cap + 2])
        self.assertTrue(all(arcases.required(arcases.cls(op, d)) for op, d, _ in p))


def ar_ledger(*events, comm="default"):
    """A ledger of all-reduces from (bytes, op, dtype, enq, execs) events."""
    L = common.Ledger()
    for b, op, d, enq, execs in events:
        L.allreduce(b, op, d, enq=enq, execs=execs, comm=comm)
    return L


def arstats(launches, allreduces, launch_bytes=None, bytes_=None, forwarded=0, errors=0, calls=None, **extra):
    st = {"intercepted": {"launches": 0, "gathers": 0, "forwarded": 0, "errors": 0},
          common.AR_SECTION: {k: v for k, v in {"launches": launches, "allreduces": allreduces, "launch_bytes": launch_bytes,
                                                "bytes": bytes_, "forwarded": forwarded, "errors": errors}.items()
                              if v is not None}}
    st[common.AR_SECTION].update(extra)
    if calls is not None:
        st["interceptor"] = {"way_in": "hooked", "ncclAllReduce": calls}
    return st


class AllReduceLedgerTest(unittest.TestCase):
    W = (0, 262144)

    def test_one_agreement_for_both_collectives(self):
        L = common.Ledger()
        L.allreduce(16, "sum", "bfloat16", enq=1, execs=0)  # captured before any agreement: NCCL's
        L.allreduce(16, "sum", "bfloat16", enq=0, execs=5)
        L.allreduce(4096, "sum", "float32")  # the first eager call of either collective agrees the communicator
        L.gather(16)
        L.gather(16, enq=1, execs=0)
        L.gather(16, enq=0, execs=3)
        L.allreduce(8, "max", "float64", enq=1, execs=0)
        L.allreduce(8, "max", "float64", enq=0, execs=2)
        n = L.n
        self.assertEqual(n["calls"]["16"], dict(first=0, eager=1, captured=1, list=0, replays=3, pre=0, replays_pre=0))
        self.assertEqual(n["allreduce"]["sum/bfloat16"]["16"], dict(first=0, eager=0, captured=0, list=0, replays=0, pre=1,
                                                                   replays_pre=5))
        self.assertEqual(n["allreduce"]["sum/float32"]["4096"]["first"], 1)
        self.assertEqual(n["allreduce"]["max/float64"]["8"], dict(first=0, eager=0, captured=1, list=0, replays=2, pre=0,
                                                                 replays_pre=0))
        with self.assertRaisesRegex(ValueError, "replays of 8 B allreduces on 'default': none was captured"):
            L.allreduce(8, "max", "float32", enq=0, execs=1)  # another class: its captures are its own
        m = common.merged(n, ar_ledger((16, "sum", "bfloat16", 2, 2), comm="other").n)
        row = m["allreduce"]["sum/bfloat16"]["16"]
        self.assertEqual((row["eager"], row["first"], row["pre"]), (2, 1, 1))  # the other communicator agreed on its own

    def test_expectation_and_exact_match(self):
        L = ar_ledger((4096, "sum", "float32", 3, 3), (4096, "sum", "float32", 2, 0), (4096, "sum", "float32", 0, 40),
                      (1 << 20, "sum", "float32", 2, 2), (16, "avg", "int8", 4, 4), (16, "sum", "float8_e4m3fn", 1, 1))
        taken = common.allreduce_taken({"avg/int8": False, "sum/float8_e4m3fn": True})
        e = common.allreduce_expectation(L.n["allreduce"], self.W, taken)
        self.assertEqual((e["launches"], e["allreduces"]), (3 + 2 + 1, 3 + 40 + 1))
        self.assertEqual((e["launch_bytes"], e["bytes"]), (5 * 4096 + 16, 43 * 4096 + 16))
        self.assertEqual((e["forwarded_min"], e["forwarded_bytes_min"]), (2 + 4, 2 * (1 << 20) + 4 * 16))
        self.assertEqual((e["calls"], e["first_in"], e["unknown"]), (3 + 2 + 2 + 4 + 1, 1, []))
        good = arstats(6, 44, e["launch_bytes"], e["bytes"], forwarded=6, calls=12)
        self.assertEqual(common.allreduce_check(good, L.n, self.W, taken), ([], mock.ANY))
        # Bytes counted for both ranks: a note.
        F, info = common.allreduce_check(arstats(6, 44, 2 * e["launch_bytes"], None, forwarded=6), L.n, self.W, taken)
        self.assertEqual(F, [])
        self.assertIn(f"{common.AR_SECTION}.launch_bytes counts both ranks' bytes", info["notes"][0])
        # Without the observation, avg/int8 and fp8 are unknown: a failure says so.
        F, _ = common.allreduce_check(good, L.n, self.W)
        self.assertEqual(F[0], "the path of avg/int8, sum/float8_e4m3fn is unknown: no class the library must take, and "
                               "the worker did not observe it")
        # The all-reduce off: every call to NCCL.
        off = common.allreduce_expectation(L.n["allreduce"], None, taken)
        self.assertEqual((off["launches"], off["forwarded_min"]), (0, 12))

    def test_float64_is_held_forwarded(self):
        # The samplers' float64 max (bench.agree_max): a class the library never takes, not unknown.
        L = ar_ledger((16, "max", "float64", 2, 2), (4096, "sum", "float32", 1, 1))
        e = common.allreduce_expectation(L.n["allreduce"], self.W, common.allreduce_taken())
        self.assertEqual((e["launches"], e["forwarded_min"], e["unknown"]), (1, 2, []))
        self.assertEqual(common.allreduce_check(arstats(1, 1, 4096, 4096, forwarded=2, calls=3), L.n, self.W)[0], [])
        self.assertIn("the difference is exactly the calls of max/float64: the library takes them",
                      common.allreduce_check(arstats(3, 3, 4096 + 32, 4096 + 32, forwarded=0, calls=3), L.n, self.W)[0][0])

    def test_mismatches_say_why(self):
        L = ar_ledger((4096, "sum", "float32", 3, 3), (16, "sum", "bfloat16", 2, 2), (4096, "avg", "int32", 2, 2))
        taken = common.allreduce_taken({"avg/int32": False})
        chk = lambda st: common.allreduce_check(st, L.n, self.W, taken)[0]
        F = chk(arstats(7, 7, forwarded=2))
        self.assertEqual(F, [f"{common.AR_SECTION}.launches=7 allreduces=7; expected launches=5 allreduces=5 (all-reduce "
                             "window 0 to 262144 bytes); the difference is exactly the calls of avg/int32: the library "
                             "takes them"])
        self.assertIn("the difference is exactly the calls of sum/float32: the library leaves them to NCCL",
                      chk(arstats(2, 2, forwarded=5))[0])
        self.assertIn("the 1 in-window calls that made each communicator's agreement: they went to NCCL",
                      chk(arstats(4, 4, forwarded=3))[0])
        self.assertIn("no all-reduce took the path", chk(arstats(0, 0, forwarded=7))[0])
        ok = dict(launch_bytes=3 * 4096 + 32, bytes_=3 * 4096 + 32, forwarded=2)
        self.assertEqual(chk(arstats(5, 5, **dict(ok, errors=1))), [f"{common.AR_SECTION}.errors=1"])
        self.assertIn("forwarded=1, but 2 calls were outside the window", chk(arstats(5, 5, **dict(ok, forwarded=1)))[0])
        self.assertEqual(chk(arstats(5, 5, **dict(ok, bytes_=99))),
                         [f"{common.AR_SECTION}.bytes=99, expected {3 * 4096 + 32} (bytes of the buffers of the calls counted)"])
        self.assertEqual(chk(arstats(5, 5, calls=6, **ok)), ["interceptor.ncclAllReduce=6, but the worker made 7 "
                                                             "ncclAllReduce calls: some did not reach the library's wrapper"])
        self.assertEqual(chk(arstats(5, 5, calls=7, **ok)), [])
        self.assertIn("no \"intercepted_allreduce\" section", chk({"intercepted": {}})[0])
        self.assertIn("no ROCE_GATHER_STATS file", chk(None)[0])

    def test_observe_classes(self):
        W = (0, 4096)
        blocks = [{"class": "sum/float32", "calls": {"16": 2, "4096": 1, "8192": 3},
                   "delta": {"launches": 3, "launch_bytes": 32 + 4096, "forwarded": 3}},
                  {"class": "avg/int8", "calls": {"16": 4, "8192": 1}, "delta": {"launches": 0, "forwarded": 5}},
                  {"class": "max/int8", "calls": {"16": 4}, "delta": {"launches": 0, "forwarded": 4}},
                  {"class": "min/int8", "calls": {"16": 2, "32": 2}, "delta": {"launches": 2, "launch_bytes": 32}},
                  {"class": "sum/float8_e5m2", "calls": {"16": 2}, "delta": None},
                  {"class": "prod/int64", "calls": {"8192": 2}, "delta": {"launches": 0}},
                  {"class": "avg/float8_e4m3fn", "calls": {}, "delta": {"launches": 0}}]
        observed, F, rows = common.observe_classes(blocks, W)
        self.assertEqual(observed, {"sum/float32": True, "avg/int8": False, "max/int8": False, "min/int8": None,
                                    "sum/float8_e5m2": None, "prod/int64": None, "avg/float8_e4m3fn": None})
        self.assertEqual(F, ["max/int8: every call went to NCCL, but the library must take this class (the issue: NCCL's "
                             "two-rank result is op(x0, x1) in rank order there)",
                             "min/int8: 2 launches of 32 bytes for its 4 in-window calls of 96 bytes: the size alone "
                             "decides which calls of a class take the path"])
        self.assertEqual([r["what"] for r in rows], ["taken", "left to NCCL", "left to NCCL", "2 launches (32 bytes)",
                                                     "no stats to read", "no call within the window",
                                                     "no call made (torch refused every one)"])
        # Calls outside the window of a taken class must be counted as NCCL's.
        blocks[0]["delta"]["forwarded"] = 2
        self.assertIn("sum/float32: forwarded grew by 2 over its block, but 3 of its calls were outside the window",
                      common.observe_classes(blocks[:1], W)[1])

    def test_stats_now(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "s.json")
            self.assertIsNone(common.stats_now(None))
            self.assertEqual(common.stats_now(p), {})  # not made yet (LD_PRELOAD makes it at the first intercepted call)
            with open(p, "w") as f:
                json.dump({common.AR_SECTION: {"launches": 7, "forwarded": 2}}, f)
            before = common.stats_now(p)
            with open(p, "w") as f:
                json.dump({common.AR_SECTION: {"launches": 9, "launch_bytes": 64, "forwarded": 2}}, f)
            self.assertEqual(common.stats_delta(before, common.stats_now(p)),
                             {"launches": 2, "launch_bytes": 64, "forwarded": 0, "forwarded_bytes": 0})
            self.assertIsNone(common.stats_delta(None, before))
            with open(p, "w") as f:
                f.write('{"intercepted_allreduce": {"launches":  1')  # a slot being rewritten
            with mock.patch.object(common.time, "sleep") as nap:
                self.assertIsNone(common.stats_now(p))
            self.assertEqual(nap.call_count, 5)

    def test_default_window_from_config_go(self):
        with tempfile.TemporaryDirectory() as d:
            go = os.path.join(d, "config.go")

            def write(entries):
                with open(go, "w") as f:
                    f.write("package plugin\n\nconst (\n\tCap = 256 << 10\n)\n\nvar DefaultWindows = map[string]FabricWindow{\n"
                            + entries + "}\n")
            write('\t"verbs": {MinBytes: 0, MaxBytes: 512 << 10, AllReduceMinBytes: 16, AllReduceMaxBytes: 1 << 20}, // x\n'
                  '\t"tcp":   {MinBytes: 0, MaxBytes: Cap, AllReduceMaxBytes: Cap},\n')
            self.assertEqual(common.default_allreduce_window("verbs", go), (16, 1 << 20))
            self.assertEqual(common.default_allreduce_window("tcp", go), (0, 262144))
            self.assertEqual(common.default_window("verbs", go), (0, 524288))
            # A struct of its own: its MinBytes and MaxBytes are not the gather's.
            write('\t"tcp": {MinBytes: 8, AllReduce: Window{MinBytes: 0, MaxBytes: 128 << 10}, MaxBytes: Cap},\n'
                  '\t"verbs": {MaxBytes: 4096, AllReduce: {Off: true}},\n')
            self.assertEqual(common.default_allreduce_window("tcp", go), (0, 131072))
            self.assertEqual(common.default_window("tcp", go), (8, 262144))
            self.assertIsNone(common.default_allreduce_window("verbs", go))
            write('\t"tcp": {MinBytes: 0, MaxBytes: Cap, AllReduceOff: true},\n')
            self.assertIsNone(common.default_allreduce_window("tcp", go))
            write('\t"tcp": {MinBytes: 0, MaxBytes: Cap},\n')
            with self.assertRaisesRegex(ValueError, r"DefaultWindows\['tcp'\] names no all-reduce window"):
                common.default_allreduce_window("tcp", go)

    def test_cli_checks_the_allreduces_too(self):
        with tempfile.TemporaryDirectory() as d:
            L = common.Ledger()
            L.allreduce(4096, "sum", "bfloat16", enq=4, execs=4)
            L.allreduce(1 << 20, "sum", "bfloat16")
            res, st = os.path.join(d, "r.json"), os.path.join(d, "s.json")
            with open(res, "w") as f:
                json.dump({"failures": [], "completed": True, "ledger": L.n, "numbers": {}}, f)

            def run(stats, **env):
                with open(st, "w") as f:
                    json.dump(stats, f)
                return subprocess.run([sys.executable, os.path.join(HERE, "common.py"), res, st], capture_output=True,
                                      text=True, env=dict(os.environ, ROCE_GATHER_FABRIC="tcp", **env,
                                                          ROCE_GATHER_ALLREDUCE_MIN_BYTES="0",
                                                          ROCE_GATHER_ALLREDUCE_MAX_BYTES="65536"))
            good = arstats(4, 4, 4 * 4096, 4 * 4096, forwarded=1)
            self.assertEqual(run(good).returncode, 0)
            p = run(arstats(5, 5, forwarded=0))
            self.assertEqual(p.returncode, 1)
            self.assertIn("intercepted_allreduce.launches=5 allreduces=5; expected launches=4", p.stdout)
            p = run(good, ROCE_GATHER_ENABLE="0")  # both collectives off: every all-reduce to NCCL
            self.assertIn("expected launches=0 allreduces=0 (all-reduce window off)", p.stdout)

    def test_config_windows(self):
        self.assertEqual(launch.allreduce_window("intercept"), common.default_allreduce_window(launch.INTERCEPT_FABRIC))
        self.assertEqual(launch.allreduce_window("intercept-preload"), launch.allreduce_window("intercept"))
        self.assertEqual(launch.allreduce_window("intercept-wide"), (0, launch.WIDE_CAP))
        self.assertIsNone(launch.allreduce_window("nccl-socket"))
        cfgs = {"a": {"NCCL_NET_PLUGIN": launch.LIB, "ROCE_GATHER_ALLREDUCE_MIN_BYTES": "64"},
                "b": {"NCCL_NET_PLUGIN": launch.LIB, "ROCE_GATHER_ENABLE": "0"},
                "c": {"NCCL_NET_PLUGIN": launch.LIB, "ROCE_GATHER_ALLREDUCE_MIN_BYTES": "9",
                      "ROCE_GATHER_ALLREDUCE_MAX_BYTES": "8"}}
        with mock.patch.dict(launch.CONFIGS, cfgs), mock.patch.object(common, "default_allreduce_window",
                                                                      return_value=(0, 65536)):
            self.assertEqual(launch.allreduce_window("a"), (64, 65536))
            self.assertIsNone(launch.allreduce_window("b"))  # ROCE_GATHER_ENABLE=0 turns both collectives off
            self.assertIsNone(launch.allreduce_window("c"))  # an empty window
            self.assertEqual(launch.intercept_window("a"), common.default_window(launch.INTERCEPT_FABRIC))

    def test_judge_both_collectives(self):
        w = launch.allreduce_window("intercept")
        L = common.Ledger()
        L.gather(16)
        L.allreduce(16, "sum", "bfloat16", enq=3, execs=3)
        L.allreduce(16, "avg", "int8", enq=2, execs=2)
        L.allreduce(w[1] + 2, "sum", "bfloat16")
        st = istats(1, 1, 16, 16, way_in="hooked")
        st.update({common.AR_SECTION: {"launches": 3, "allreduces": 3, "forwarded": 3, "errors": 0}})
        blocks = [{"class": "avg/int8", "calls": {"16": 2}, "delta": {"launches": 0, "forwarded": 2}}]
        self.assertEqual(launch.judge_stats("intercept", st, L.n, blocks)[0], [])
        F, _ = launch.judge_stats("intercept", st, L.n)  # avg/int8 not observed: unknown
        self.assertEqual(F, ["the path of avg/int8 is unknown: no class the library must take, and the worker did not "
                             "observe it"])
        st[common.AR_SECTION].update(launches=5, allreduces=5)
        F, _ = launch.judge_stats("intercept", st, L.n, blocks)
        self.assertIn("the difference is exactly the calls of avg/int8: the library takes them", F[0])
        # A ledger without all-reduces leaves the section unjudged.
        G = common.Ledger()
        G.gather(16)
        self.assertEqual(launch.judge_stats("intercept", istats(1, 1, 16, 16, way_in="hooked"), G.n)[0], [])

# ---- the all-reduce's steps from canned records ----------------------------------------------

def ar_taken_default(c):
    """The library as these tests imagine it: every required class, and avg on the integer types."""
    return arcases.required(c) or c.split("/")[1] in arcases.INTEGERS


def ar_blocks_for(cap, window, taken=ar_taken_default):
    """The class blocks a rank running the whole matrix leaves, as a library taking taken() classes would."""
    blocks = []
    for c, block in arcases.blocks(arcases.matrix_cases(cap)):
        calls = {}
        for x in block:
            b = str(x["count"] * arcases.DTYPES[x["dtype"]]["size"])
            calls[b] = calls.get(b, 0) + 1
        inside = {int(b): n for b, n in calls.items() if window and window[0] <= int(b) <= window[1]}
        n_in = sum(inside.values()) if taken(c) else 0
        blocks.append({"class": c, "calls": calls, "refused": 0, "delta": {
            "launches": n_in, "launch_bytes": sum(b * n for b, n in inside.items()) if taken(c) else 0,
            "forwarded": sum(calls.values()) - n_in}})
    return blocks


def agreement_line(rank, gw, aw):
    return (f"vm:1:2 [{rank}] NCCL INFO NET/roce_gather : one-shot gather and all-reduce on for communicator 0x5a, rank "
            f"{rank} of 2 (peer 127.0.0.1:4242): gather window {gw[0]} to {gw[1]} bytes a rank, all-reduce window {aw[0]} "
            f"to {aw[1]} bytes, chunks from 262144 bytes\n")


class AllReduceStepTest(StepHarness):
    def fake(self, calls, shape=None):
        """Pairs of allreduce_cases.py: every case's digest the same on both ranks and every run, the class
        blocks of ar_blocks_for, the agreement's line on both ranks with the library; shape(config, rec)."""
        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((run, config, worker, task, params, extra_env))
            w = launch.allreduce_window(config) if launch.uses_plugin(config) else None
            digests = {c["name"]: "d-" + c["name"] for c in arcases.matrix_cases(params["cap"])}
            res = {"completed": True, "failures": [], "n_failures": 0, "cases": len(digests), "digests": digests,
                   "numbers": {"ar_blocks": ar_blocks_for(params["cap"], w) if w else [], "ref_differs": {}, "refused": {},
                               "missing_dtypes": [], "torch": "2.11.0"}, "ledger": common.Ledger().n}
            rec = record(run, config, {}, work, results=[res, json.loads(json.dumps(res))], sizes=[16])
            if w:
                for r, p in enumerate(rec["logs"]):
                    with open(p, "a") as f:
                        f.write(agreement_line(r, launch.intercept_window(config), w))
            if shape:
                shape(config, rec)
            return rec
        return fake

    def test_passes(self):
        calls = []
        d = self.run_step("allreduce", self.fake(calls))
        self.assertEqual(d["status"], "pass", d["failures"])
        cap = launch.allreduce_window("intercept")[1]
        self.assertEqual([(c[0], c[1], c[2], c[3]) for c in calls],
                         [(f"allreduce.{c}", c, "allreduce_cases.py", "matrix") for c in
                          ("nccl-socket", "intercept", "intercept-preload")])
        self.assertEqual([c[4] for c in calls], [{"cap": cap, "replays": 16}] * 3)
        self.assertEqual(calls[0][5], {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"})  # the agreement's line
        n = len(arcases.matrix_cases(cap))
        self.assertEqual(d["headline"], f"{n} all-reduces a rank, cap {measure.size_label(cap)}; byte-identical on both "
                                        "ranks and to nccl-socket's, every in-window all-reduce intercepted: intercept, "
                                        "intercept-preload")
        self.assertIn(f"| allreduce.intercept | {n} | {n}/{n} | {2 * n}/{2 * n} | 0 (NCCL's own: 0) | 0 | 35/50 | yes |",
                      d["md"][0])
        table = d["md"][1]
        self.assertIn("The path each class took in intercept", table)
        self.assertIn("| int8 | taken | taken | taken | taken | taken (the library's choice) |", table)
        self.assertIn("| float8_e4m3fn | NCCL (the library's choice) |", table)
        self.assertEqual(d["numbers"]["classes"]["intercept"]["avg/int32"], True)
        self.assertEqual(d["numbers"]["classes"]["intercept"]["sum/float8_e5m2"], False)

    def test_failures(self):
        def shape(config, rec):
            r0, r1 = rec["results"]
            if config == "nccl-socket":
                for r in (r0, r1):
                    r["numbers"]["ref_differs"] = {"avg/float16/inplace/1": "1 of 1 elements differ"}
                    r["numbers"]["refused"] = {"avg/float8_e5m2/inplace/1": "DistBackendError: invalid argument"}
            if config == "intercept":
                r1["digests"]["sum/float32/inplace/1"] = "other"
                for r in (r0, r1):
                    blk = next(b for b in r["numbers"]["ar_blocks"] if b["class"] == "max/int32")
                    blk["delta"].update(launches=0, launch_bytes=0, forwarded=sum(blk["calls"].values()))
                with open(rec["logs"][0], "a") as f:  # a second communicator's line with another window
                    f.write(agreement_line(0, launch.intercept_window(config), (0, 4096)))
            if config == "intercept-preload":
                for r in (r0, r1):
                    r["numbers"]["ref_differs"] = {"avg/float16/inplace/1": "1 of 1 elements differ",
                                                   "prod/int8/inplace/3el": "1 of 3 elements differ, first at 2"}
                    r["numbers"]["refused"] = {"avg/float8_e5m2/inplace/1": "DistBackendError: invalid argument",
                                               "sum/float8_e4m3fn/inplace/1": "TypeError: no"}
                with open(rec["logs"][1], "w") as f:
                    f.write("no agreement here\n")
        d = self.run_step("allreduce", self.fake([], shape))
        self.assertEqual(d["status"], "fail")
        F = d["failures"]
        aw = launch.allreduce_window("intercept")
        gw = launch.intercept_window("intercept")
        want = ["allreduce.intercept sum/float32/inplace/1: the ranks' outputs differ",
                "rank 1 sum/float32/inplace/1: output of intercept differs from nccl-socket",
                "allreduce.intercept rank 0: max/int32: every call went to NCCL, but the library must take this class (the "
                "issue: NCCL's two-rank result is op(x0, x1) in rank order there)",
                f"allreduce.intercept rank 0: the agreement names gather window {gw[0]} to {gw[1]} and all-reduce window 0 to "
                f"4096; expected {gw[0]} to {gw[1]} and {aw[0]} to {aw[1]} (plugin/config.go's defaults and the config's "
                "variables)",
                "allreduce.intercept-preload prod/int8/inplace/3el: not op(x0, x1) in rank order: 1 of 3 elements differ, "
                "first at 2",
                "allreduce.intercept-preload sum/float8_e4m3fn/inplace/1: refused (TypeError: no), though nccl-socket's "
                "run took it",
                "allreduce.intercept-preload rank 1: no agreement line (\"one-shot gather and all-reduce on for communicator "
                "...\") in its log"]
        for f in want:
            self.assertIn(f, F)
        self.assertEqual(len(F), len(want) + 1, F)  # and rank 1's verdict on max/int32
        self.assertTrue(any("NCCL's own result is not op(x0, x1) in rank order in 1 cases" in n for n in d["notes"]))
        self.assertTrue(d["headline"].endswith("every in-window all-reduce intercepted: none"), d["headline"])


class AllReduceTimingStepsTest(StepHarness):
    def arlatency_fake(self, calls, shape=None):
        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((run, config, worker, params))
            sizes = params["collectives"]["allreduce"]
            sock = {b: 40 + b / 1024 for b in sizes}
            f = lambda b: 1.0 if config == "nccl-socket" else 0.5 if b <= 65536 else 0.95  # noqa: E731
            us = {b: v * f(b) for b, v in sock.items()}
            if shape:
                us = {b: shape(config, b, v) for b, v in us.items()}
            return record(run, config, {"samples": {"graph": samples_for(us)}, "agreed": True}, work, sizes=sizes)
        return fake

    def test_arlatency(self):
        calls = []
        d = self.run_step("arlatency", self.arlatency_fake(calls))
        self.assertEqual(d["status"], "pass", d["failures"] + d["notes"])
        self.assertEqual([c[0] for c in calls[:4]], ["arlatency.r0.nccl-socket", "arlatency.r0.intercept",
                                                     "arlatency.r1.intercept", "arlatency.r1.nccl-socket"])
        self.assertEqual(len(calls), 2 * 4)
        self.assertEqual({c[2] for c in calls}, {"bench.py"})
        self.assertEqual(calls[0][3]["collectives"], {"allreduce": plans.LATENCY_SIZES})
        self.assertEqual([g["goal"] for g in d["numbers"]["goals"]],
                         ["intercept's median <= 0.6x NCCL socket's, 16 B to 64 KiB",
                          "the path the size picks is never slower than NCCL socket beyond the spread, 16 B to 4 MiB"])
        md = d["md"][0]
        self.assertIn("(4 all-reduces a graph)", md)
        self.assertIn("µs an all-reduce, median (min-max)", md)
        self.assertIn("| bytes of the buffer | path in intercept | nccl-socket | intercept | intercept/socket | vs socket | "
                      "goal | met |\n", md)
        self.assertIn("| 8 KiB | intercepted |", md)
        self.assertIn("| 4 MiB | NCCL (outside the window) |", md)
        self.assertNotIn("intercept-nonap", md)
        self.assertTrue(any(m.startswith("ROCE_GATHER_STATS per rank, the intercepted all-reduce") for m in d["md"]))
        with open(os.path.join(self.work, "allreduce-latency.csv")) as f:
            rows = list(csv.reader(f))
        self.assertEqual(rows[0], ["config", "mode", "bytes", "round", "rep", "us_per_allreduce"])
        self.assertEqual(len(rows) - 1, 2 * 4 * 19 * 3)
        self.assertEqual(measure.read_latency_csv(os.path.join(self.work, "allreduce-latency.csv"))["graph"]["intercept"][16]["n"], 12)

    def test_plot_both_latencies(self):
        import types
        made = []
        fake = types.ModuleType("plot")
        fake.plot = lambda src, dst, what="gather": made.append((os.path.basename(src), os.path.basename(dst), what))
        with mock.patch.dict(sys.modules, {"plot": fake}):
            d = self.run_step("plot", None)
            self.assertEqual((d["status"], made), ("skip", []))
            for name in ("latency.csv", "allreduce-latency.csv"):
                measure.write_csv(os.path.join(self.work, name), ["config", "mode", "bytes", "round", "rep", "us"],
                                  [["intercept", "graph", 16, 0, 0, "1.0"]])
            d = self.run_step("plot", None)
        self.assertEqual(made, [("latency.csv", "latency.png", "gather"),
                                ("allreduce-latency.csv", "allreduce-latency.png", "all-reduce")])
        self.assertEqual((d["status"], d["headline"]), ("pass", "latency.png, allreduce-latency.png"))

    def test_arlatency_goals_missed(self):
        def shape(config, b, us):
            if config == "intercept" and b == 4096:
                return us * 1.24  # 0.62x
            if config == "intercept" and b == 1 << 20:
                return us * 1.2  # slower than NCCL beyond the spread
            return us
        d = self.run_step("arlatency", self.arlatency_fake([], shape), {"ROCE_GATHER_GPU_ARLATENCY_ROUNDS": "2"})
        self.assertEqual(d["status"], "warn")
        g = d["numbers"]["goals"]
        self.assertEqual([tuple(x) for x in g[0]["failed"]], [(4096, "0.62x")])
        self.assertEqual([b for b, _ in g[1]["failed"]], [1 << 20])
        self.assertEqual(d["numbers"]["rounds"], 2)

    def decode_fake(self, calls, ratio, digest=None):
        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            calls.append((run, config, params))
            batches = params["collectives"]["decode"]
            us = {b: {1: 3500.0, 4: 3900.0}[b] * ratio(config, b) for b in batches}
            rec = record(run, config, {"samples": {"graph": samples_for(us)}, "agreed": True}, work, sizes=[16])
            for r, res in enumerate(rec["results"]):
                res["digests"] = {f"decode/batch{b}/{k}": f"{k}{b}" for b in batches for k in ("logits", "hidden")}
                if digest:
                    digest(config, r, res["digests"])
            return rec
        return fake

    def test_decode(self):
        calls = []
        ratio = lambda c, b: {"nccl-socket": 1.0, "intercept": 0.5, "intercept-preload": 0.6 if b == 1 else 0.75}[c]
        d = self.run_step("decode", self.decode_fake(calls, ratio))
        self.assertEqual(d["status"], "warn", d["failures"])
        self.assertEqual(len(calls), 3 * 4)
        self.assertEqual([c[1] for c in calls[3:6]], ["intercept", "intercept-preload", "nccl-socket"])
        self.assertEqual(calls[0][2], plans.DECODE["params"])
        g = d["numbers"]["goals"]
        self.assertEqual([(x["goal"], x["pass"]) for x in g],
                         [("intercept's median step <= 0.7x NCCL socket's, batch 1 and 4", True),
                          ("intercept-preload's median step <= 0.7x NCCL socket's, batch 1 and 4", False)])
        self.assertEqual([tuple(x) for x in g[1]["failed"]], [(4, "0.75x")])
        md = d["md"][0]
        self.assertIn("Llama-3-8B (32 layers, hidden 4096, vocabulary 128256, bfloat16)", md)
        gw, aw = launch.intercept_window("intercept"), launch.allreduce_window("intercept")
        self.assertEqual(plans.decode_sizes(1), {"gather": 4096, "allreduce": 8192, "logits": 128256})
        self.assertEqual(d["numbers"]["paths"][1], plans.decode_paths(1, gw, aw, plans.decode_sizes(1)))
        self.assertIn("gathers 4 KiB a rank (intercepted), all-reduces 8 KiB (intercepted), logits 128256 B a rank "
                      "(intercepted)", d["numbers"]["paths"][1])
        self.assertIn("logits 501 KiB a rank (NCCL)", d["numbers"]["paths"][4])  # above the gather's cap
        self.assertIn("| 1 | gathers 4 KiB a rank (intercepted)", md)
        self.assertIn("| 0.50 (0.48-0.52) | met | 0.60 (0.58-0.62) | met |", md)
        self.assertIn("| 0.75 (0.72-0.78) | MISSED |", md)
        self.assertTrue(d["headline"].startswith("goals met: 1/2; intercept/socket batch 1 0.50"), d["headline"])
        self.assertEqual(d["failures"], [])

    def test_decode_outputs_must_agree(self):
        def digest(config, r, digests):
            if config == "intercept" and r == 1:
                digests["decode/batch4/hidden"] = "other"
        d = self.run_step("decode", self.decode_fake([], lambda c, b: 0.5 if c != "nccl-socket" else 1.0, digest),
                          {"ROCE_GATHER_GPU_DECODE_ROUNDS": "1"})
        self.assertEqual(d["status"], "fail")
        self.assertEqual(d["failures"], ["decode.r0.intercept rank 1: decode/batch4/hidden differs from "
                                         "decode.r0.nccl-socket rank 0's"])

    def test_report_shows_both_latencies_and_the_decode_goal(self):
        self.run_step("arlatency", self.arlatency_fake([]), {"ROCE_GATHER_GPU_ARLATENCY_ROUNDS": "1"})
        self.run_step("decode", self.decode_fake([], lambda c, b: 0.5 if c != "nccl-socket" else 1.0),
                      {"ROCE_GATHER_GPU_DECODE_ROUNDS": "1"})
        out = os.path.join(self.work, "out")
        argv = ["report.py", "--work", self.work, "--out", out, "--steps", "arlatency decode", "--start", str(time.time())]
        with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(self.out):
            with self.assertRaises(SystemExit) as e:
                report.main()
        self.assertEqual(e.exception.code, 0)
        text = self.out.getvalue()
        self.assertIn("us per all-reduce under CUDA graph replay, median (min-max):", text)
        self.assertIn("goal met: intercept's median <= 0.6x NCCL socket's, 16 B to 64 KiB", text)
        self.assertIn("decode goal met: intercept's median step <= 0.7x NCCL socket's, batch 1 and 4", text)
        self.assertEqual(sorted(os.listdir(out)), ["allreduce-latency.csv", "decode.csv", "results.tar.gz", "summary.json",
                                                   "summary.md"])

    def calibrate_fake(self, bad_run=None):
        """Calibration pairs measuring both collectives; the stats of bad_run's ranks miss one all-reduce."""
        sizes = calibrate.SIZES

        def fake(work, run, config, worker, task, timeout, params=None, extra_env=None, **kw):
            role = params["role"]
            g = {b: 30 + b / 4096 for b in sizes}
            a = {b: 40 + b / 2048 for b in sizes}
            if role == "intercept":
                g = {b: v * (0.7 if 4096 <= b <= 131072 else 1.4) for b, v in g.items()}
                a = {b: v * (0.5 if b <= 65536 else 1.3) for b, v in a.items()}
            by = {"gather": {"graph": samples_for(g)}, "allreduce": {"graph": samples_for(a)}}
            rec = record(run, config, {"samples": by["gather"], "samples_by": by, "agreed": True}, work, sizes=sizes)
            L = common.Ledger()
            for b in sizes:
                L.gather(b, enq=8, execs=8)
                L.allreduce(b, "max", "bfloat16", enq=8, execs=8)
            for res in rec["results"]:
                res.update(params=params, ledger=json.loads(json.dumps(L.n)))
            if role == "intercept":
                n = len(sizes) * 8
                st = istats(n, n, 8 * sum(sizes), 8 * sum(sizes), way_in="hooked")
                st[common.AR_SECTION] = {"launches": n, "allreduces": n - 1 if run == bad_run else n, "errors": 0,
                                         "forwarded": 0}
                rec["stats"] = [st, st]
            return rec
        return fake

    def test_calibrate_both_collectives(self):
        seen = []
        fake = self.calibrate_fake()
        d = self.run_step("calibrate", lambda *a, **kw: seen.append(a[4]) or fake(*a, **kw))
        self.assertEqual(d["status"], "pass", d["failures"])
        self.assertEqual({t for t in seen}, {"calibrate"})
        self.assertEqual(launch.allreduce_window("intercept-wide"), (0, launch.WIDE_CAP))  # every size on the path
        self.assertEqual(d["numbers"]["env"], "export ROCE_GATHER_MIN_BYTES=4096 ROCE_GATHER_MAX_BYTES=131072")
        self.assertEqual(d["numbers"]["allreduce"]["env"],
                         "export ROCE_GATHER_ALLREDUCE_MIN_BYTES=16 ROCE_GATHER_ALLREDUCE_MAX_BYTES=65536")
        self.assertIn("The all-reduce:", d["md"][0])
        self.assertIn("    export ROCE_GATHER_ALLREDUCE_MIN_BYTES=16 ROCE_GATHER_ALLREDUCE_MAX_BYTES=65536", d["md"][0])
        self.assertEqual(d["headline"], "gather window 4 KiB to 128 KiB: export ROCE_GATHER_MIN_BYTES=4096 "
                                        "ROCE_GATHER_MAX_BYTES=131072; all-reduce window 16 B to 64 KiB: export "
                                        "ROCE_GATHER_ALLREDUCE_MIN_BYTES=16 ROCE_GATHER_ALLREDUCE_MAX_BYTES=65536")
        # calibrate.1.intercept's stats miss one all-reduce on both ranks: no answer.
        d = self.run_step("calibrate", self.calibrate_fake("calibrate.1.intercept"))
        self.assertEqual(d["status"], "fail")
        self.assertIsNone(d["numbers"]["env"])
        self.assertTrue(any(f.startswith("calibrate.1.intercept rank 1 stats: intercepted_allreduce.launches=")
                            for f in d["failures"]), d["failures"])
        self.assertTrue(any(f.startswith("calibrate.1.intercept stats: intercepted_allreduce.launches=")
                            for f in d["failures"]), d["failures"])

    def test_window_lines(self):
        none = {"floor": None, "cap": None}
        self.assertEqual(measure.window_env(none), "export ROCE_GATHER_ENABLE=0")
        self.assertEqual(measure.window_env(none, other_on=True), "export ROCE_GATHER_MIN_BYTES=2 ROCE_GATHER_MAX_BYTES=1")
        self.assertEqual(measure.window_env(none, "ROCE_GATHER_ALLREDUCE"),
                         "export ROCE_GATHER_ALLREDUCE_MIN_BYTES=2 ROCE_GATHER_ALLREDUCE_MAX_BYTES=1")
        self.assertEqual(measure.window_env({"floor": 16, "cap": 4096}, "ROCE_GATHER_ALLREDUCE"),
                         "export ROCE_GATHER_ALLREDUCE_MIN_BYTES=16 ROCE_GATHER_ALLREDUCE_MAX_BYTES=4096")

        def runs(g_faster, a_faster):
            out = []
            for i, role in calibrate.plan(1):
                f = lambda faster: 0.5 if role == "intercept" and faster else 1.5 if role == "intercept" else 1.0
                by = {"gather": {"graph": samples_for({16: 20 * f(g_faster), 4096: 30 * f(g_faster)})},
                      "allreduce": {"graph": samples_for({16: 25 * f(a_faster), 4096: 35 * f(a_faster)})}}
                out.append({"name": f"r{i}", "role": role, "stats": None,
                            "result": {"completed": True, "failures": [], "ledger": None, "numbers": {"samples_by": by}}})
            return out
        a = calibrate.analyse(runs(False, True))
        self.assertEqual((a["env"], a["allreduce"]["env"]), ("export ROCE_GATHER_MIN_BYTES=2 ROCE_GATHER_MAX_BYTES=1",
                                                             "export ROCE_GATHER_ALLREDUCE_MIN_BYTES=16 "
                                                             "ROCE_GATHER_ALLREDUCE_MAX_BYTES=4096"))
        a = calibrate.analyse(runs(False, False))
        self.assertEqual((a["env"], a["allreduce"]["env"]), ("export ROCE_GATHER_ENABLE=0", None))
        a = calibrate.analyse(runs(True, False))
        self.assertEqual(a["allreduce"]["env"], "export ROCE_GATHER_ALLREDUCE_MIN_BYTES=2 ROCE_GATHER_ALLREDUCE_MAX_BYTES=1")
        self.assertIn("Window: none.", calibrate.report(a).split("The all-reduce:")[1])
        # A run of the gather alone (an older worker): no all-reduce in the answer.
        old = [dict(r, result=dict(r["result"], numbers={"samples": r["result"]["numbers"]["samples_by"]["gather"]}))
               for r in runs(True, True)]
        self.assertIsNone(calibrate.analyse(old)["allreduce"])

# ---- the all-reduce's workers against the stand-in torch --------------------------------------

def ar_calls(ledger):
    """(calls made, calls run) of a ledger's all-reduces, as the interceptor would see them."""
    rows = [r for by in ledger["allreduce"].values() for r in by.values()]
    return (sum(r["eager"] + r["captured"] + r["pre"] for r in rows), sum(r["eager"] + r["replays"] + r["replays_pre"]
                                                                        for r in rows))


class BenchCollectivesTest(unittest.TestCase):
    run_task = BenchTest.run_task

    def test_allreduce_samples_and_ledger(self):
        ctx, res, counts, _ = self.run_task({"collectives": {"allreduce": [16, 4096]}, "modes": ["graph"], "reps": 2,
                                             "budget_s": 60})
        self.assertEqual(res.d["n_failures"], 0, res.d["failures"])  # max(x0, x1) after every sample
        n = res.d["numbers"]
        self.assertEqual(list(n["samples_by"]), ["allreduce"])
        self.assertIs(n["samples"], n["samples_by"]["allreduce"])
        self.assertEqual(len(n["samples"]["graph"]["4096"]), 2)
        self.assertEqual(n["replays"]["allreduce/16"], 100)
        self.assertEqual(ctx.ledger.n["calls"], {})  # no gather
        L = ctx.ledger.n["allreduce"]
        self.assertEqual(sorted(L), ["max/bfloat16", "max/float64", "sum/float32"])  # the sampled ones, agree_max, sync_peers
        self.assertEqual(sorted(L["max/bfloat16"]), ["16", "4096"])
        self.assertEqual(ar_calls(ctx.ledger.n), (counts["ar_enq"], counts["ar_exec"]))
        self.assertEqual(L["max/bfloat16"]["16"]["first"], 1)  # its first warm-up call made the agreement

    def test_decode_step(self):
        ctx, res, counts, _ = self.run_task({"collectives": {"decode": [1, 4]}, "modes": ["graph"], "reps": 2,
                                             "budget_s": 60})
        self.assertEqual(res.d["n_failures"], 0, res.d["failures"])
        n = res.d["numbers"]
        self.assertEqual(sorted(n["samples"]["graph"]), ["1", "4"])
        # Each replay is one step of 32 layers: its ledger holds every call the step made, per size.
        L = ctx.ledger.n
        self.assertEqual(sum(r["eager"] + r["captured"] for r in L["calls"].values()), counts["enq"])
        self.assertEqual(sum(r["eager"] + r["replays"] for r in L["calls"].values()), counts["exec"])
        self.assertEqual(ar_calls(L), (counts["ar_enq"], counts["ar_exec"]))
        s1, s4 = plans.decode_sizes(1), plans.decode_sizes(4)
        self.assertEqual(sorted(L["calls"]), sorted(str(x) for x in (s1["gather"], s1["logits"], s4["gather"], s4["logits"])))
        self.assertEqual(sorted(L["allreduce"]["sum/bfloat16"]), sorted([str(s1["allreduce"]), str(s4["allreduce"])]))
        g1, l1 = L["calls"][str(s1["gather"])], L["calls"][str(s1["logits"])]
        self.assertEqual((g1["captured"], l1["captured"]), (32, 1))
        self.assertEqual(g1["replays"], 32 * l1["replays"])
        self.assertEqual(L["allreduce"]["sum/bfloat16"][str(s1["allreduce"])]["replays"], g1["replays"])
        self.assertEqual(sorted(res.d["digests"]), ["decode/batch1/hidden", "decode/batch1/logits", "decode/batch4/hidden",
                                                   "decode/batch4/logits"])

    def test_calibrate_measures_both_collectives(self):
        ctx, res, _, _ = self.run_task({"role": "intercept", "sizes": [16, 1 << 20], "reps": 1}, task="calibrate")
        self.assertEqual(res.d["n_failures"], 0, res.d["failures"])
        self.assertEqual(list(res.d["numbers"]["samples_by"]), ["gather", "allreduce"])
        self.assertEqual(sorted(ctx.ledger.n["allreduce"]["max/bfloat16"]), ["1048576", "16"])
        ctx, res, _, _ = self.run_task({"role": "intercept", "sizes": [16], "reps": 1, "measure": ["gather"]},
                                       task="calibrate")
        self.assertEqual(list(res.d["numbers"]["samples_by"]), ["gather"])


def import_with(mods, name):
    """Module name imported against the stand-in torch (fake_torch), and out of sys.modules again."""
    with mock.patch.dict(sys.modules, mods):
        for m in (name, "torch_cases", "allreduce_cases"):
            sys.modules.pop(m, None)
        mod = __import__(name)
        for m in (name, "torch_cases", "allreduce_cases"):
            sys.modules.pop(m, None)
    return mod


class AllReduceCasesTest(unittest.TestCase):
    """allreduce_cases.py's matrix without a GPU: each class run as one block with the stats read
    around it, the calls it made counted by size, refusals and types torch lacks kept apart."""

    def test_blocks(self):
        mods, _ = fake_torch()
        ac = import_with(mods, "allreduce_cases")
        res = mock.Mock()
        res.d = {"numbers": {}, "cases": 0, "digests": {}}
        ctx = mock.Mock(rank=0, dev="cuda:0", res=res)
        ctx.ledger = common.Ledger()
        launched = {"n": 0}
        refused = {"prod/int8/inplace/1", "avg/int8/copy/1"}

        def case(self, c):
            if c["name"] in refused:
                self.num["refused"][c["name"]] = "TypeError: no"
                return False
            self.ctx.ledger.allreduce(c["count"] * arcases.DTYPES[c["dtype"]]["size"], c["op"], c["dtype"])
            launched["n"] += c["count"] <= 1000  # what the stand-in library takes: up to 1000 elements
            return True
        with mock.patch.dict(sys.modules, mods), mock.patch.object(ac.Cases, "case", case), \
                mock.patch.dict(os.environ, {"ROCE_GATHER_STATS": "/s.json"}), \
                mock.patch.object(common, "stats_now", lambda path: {"launches": launched["n"]} if path else None), \
                contextlib.redirect_stdout(io.StringIO()):
            cases = ac.Cases(ctx)
            cases.matrix(arcases.matrix_cases(4096))
        n = res.d["numbers"]
        self.assertEqual(n["missing_dtypes"], ["float8_e4m3fn", "float8_e5m2"])  # this torch has none
        self.assertEqual([b["class"] for b in n["ar_blocks"]], [c for c, _ in arcases.blocks(arcases.matrix_cases(4096))
                                                                if "float8" not in c])
        by = {b["class"]: b for b in n["ar_blocks"]}
        i8 = arcases.counts("int8", 4096)
        self.assertEqual(by["prod/int8"]["refused"], 1)
        self.assertEqual(sum(by["prod/int8"]["calls"].values()), len(dict(arcases.blocks(arcases.matrix_cases(4096)))["prod/int8"]) - 1)
        self.assertEqual(by["sum/int8"]["calls"]["1"], 1 + 1)  # one element, in place and copied
        self.assertEqual(by["sum/int8"]["delta"]["launches"], sum(1 for c in dict(arcases.blocks(arcases.matrix_cases(4096)))
                                                                  ["sum/int8"] if c["count"] <= 1000))
        self.assertEqual(by["sum/int8"]["delta"]["forwarded"], 0)
        self.assertEqual(set(i8.values()) - {int(b) for b in by["sum/int8"]["calls"]}, set())
        self.assertEqual(n["refused"], {k: "TypeError: no" for k in refused})
        self.assertEqual(sum(r["eager"] for b in ctx.ledger.n["allreduce"].values() for r in b.values()),
                         sum(sum(b["calls"].values()) for b in n["ar_blocks"]))
        self.assertEqual(res.write.call_count, 40)  # after every class


class PyncclAllReduceTest(unittest.TestCase):
    def test_cases_and_their_ledger(self):
        mods, _ = fake_torch()
        torch = mods["torch"]
        T = torch.FakeTensor
        torch.zeros_like = lambda t: T(("zeros",))
        issued, captured, state = [], [], {"capturing": False, "group": 0}

        class Graph:
            def replay(self):
                issued.extend(("replay",) + c for c in captured)

        @contextlib.contextmanager
        def graph(g, capture_error_mode=None):
            state["capturing"] = True
            yield
            state["capturing"] = False
        torch.cuda.CUDAGraph, torch.cuda.graph = Graph, graph
        pc = import_with(mods, "pynccl_cases")
        ac = import_with(mods, "allreduce_cases")

        def allreduce(self, out, inp, count, dtype, op, stream=None):
            call = (op, dtype, count, "inplace" if out is inp else "outofplace", state["group"])
            (captured if state["capturing"] else issued).append(call if state["capturing"] else ("eager",) + call)
        nccl = mock.Mock()
        nccl.f = {"ncclGroupStart": lambda: state.__setitem__("group", state["group"] + 1) or 0,
                  "ncclGroupEnd": lambda: state.__setitem__("group", state["group"] - 1) or 0}
        nccl.check = lambda what, r: None
        res = mock.Mock()
        res.d = {"cases": 0}
        cases_ = [("sum", "bfloat16", 8), ("max", "float16", 2048)]
        with mock.patch.dict(sys.modules, dict(mods, allreduce_cases=ac)), \
                mock.patch.object(pc.Cases, "allreduce", allreduce), \
                mock.patch.object(pc.Cases, "ar_verify", lambda self, name, out, x, op, dtype: None), \
                mock.patch.object(ac, "gen", lambda tag, r, n, dtype: T(("gen", r, n, tag))):
            c = pc.Cases(mock.Mock(rank=0, local=0), res, nccl, "comm")
            c.ledger = common.Ledger()
            c.ledger.gather(16)  # the binding's gathers come first and agree the communicator
            c.run_allreduce(cases_, 3)
        self.assertEqual(issued[:6], [("eager", "sum", "bfloat16", 8, "outofplace", 0), ("eager", "max", "float16", 2048, "outofplace", 0),
                                      ("eager", "sum", "bfloat16", 8, "inplace", 0), ("eager", "max", "float16", 2048, "inplace", 0),
                                      ("eager", "sum", "bfloat16", 8, "outofplace", 1), ("eager", "max", "float16", 2048, "outofplace", 1)])
        self.assertEqual(captured, [("sum", "bfloat16", 8, "outofplace", 0), ("max", "float16", 2048, "outofplace", 0)])
        self.assertEqual(issued[6:], [("replay",) + x for x in captured] * 3)
        L = c.ledger.n["allreduce"]
        self.assertEqual(L["sum/bfloat16"]["16"], dict(first=0, eager=3, captured=1, list=0, replays=3, pre=0, replays_pre=0))
        self.assertEqual(L["max/float16"]["4096"], dict(first=0, eager=3, captured=1, list=0, replays=3, pre=0, replays_pre=0))


class CompareBuildsTest(unittest.TestCase):
    def test_a_build_is_named_by_its_file(self):
        self.assertEqual("lib-edcb883", compare_builds.build_name("build/old/lib-edcb883.so"))
        self.assertEqual("lib-roce_gather", compare_builds.build_name("/x/libroce_gather.so"))
        self.assertEqual("lib-v2", compare_builds.build_name("v2.so"))


if __name__ == "__main__":
    unittest.main()
