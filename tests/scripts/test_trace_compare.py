#!/usr/bin/env python3
"""scripts/trace_compare.py: measured against predicted op by op, from the two traces that
`oom-train --trace-step` writes. Synthetic traces check the pairing and the sums; where the
oom-train binary is given, a host run's own traces go through it end to end.
Usage: test_trace_compare.py REPO_ROOT [OOM_TRAIN]"""
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
OOM_TRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else None
spec = importlib.util.spec_from_file_location("trace_compare", os.path.join(REPO, "scripts", "trace_compare.py"))
tc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tc)


def trace(path, spans, host=()):
    """A Chrome trace as oom's ChromeTrace writes it: tracks named by meta events, X spans in us."""
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "gpu_compute"}},
              {"name": "thread_name", "ph": "M", "pid": 0, "tid": 5, "args": {"name": "host (issuing thread)"}}]
    for name, begin, dur in spans:
        events.append({"name": name, "ph": "X", "pid": 0, "tid": 0, "ts": begin * 1e6, "dur": dur * 1e6})
    for name, begin, dur in host:
        events.append({"name": name, "ph": "X", "pid": 0, "tid": 5, "ts": begin * 1e6, "dur": dur * 1e6})
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events}, f)


def run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = tc.main(argv)
    if rc != 0:
        raise AssertionError(f"trace_compare.main({argv}) returned {rc}")
    return out.getvalue()


def table(text):
    """{(layer, op): (measured, predicted, ratio)} of the printed rows ('-' kept as None)."""
    rows = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        layer, (m, p, r), op = fields[0], fields[-3:], " ".join(fields[1:-3])
        val = lambda x: None if x == "-" else float(x)  # noqa: E731
        rows[(layer, op)] = (val(m), val(p), val(r))
    return rows


class TraceCompare(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.measured = os.path.join(self.dir.name, "trace-step-3.json")
        # Two layers; layer 1 recomputed around kept attention state. Halves nested in the passes.
        trace(self.measured, [
            ("fwd layers.0", 0.0, 0.010), ("fwd.attention layers.0", 0.0, 0.004), ("fwd.mlp layers.0", 0.004, 0.006),
            ("fwd layers.1", 0.010, 0.012), ("fwd.attention layers.1", 0.010, 0.005), ("fwd.mlp layers.1", 0.015, 0.007),
            ("recompute (attention kept) layers.1", 0.03, 0.004), ("recompute.attention layers.1", 0.03, 0.001),
            ("recompute.mlp layers.1", 0.031, 0.003),
            ("bwd layers.1", 0.034, 0.020), ("bwd.mlp layers.1", 0.034, 0.012), ("bwd.attention layers.1", 0.046, 0.008),
            ("h2d weights layers.1", 0.0, 0.002), ("loss", 0.02, 0.009), ("embedding backward", 0.06, 0.001),
        ], host=[("issue fwd layers.0", 0.0, 0.5), ("wait for the loss", 0.02, 0.3)])
        trace(os.path.join(self.dir.name, "trace-step-3.predicted.json"), [
            ("fwd.attention L0", 0, 0.002), ("fwd.mlp L0", 0, 0.006), ("fwd.attention L1", 0, 0.005), ("fwd.mlp L1", 0, 0.007),
            ("recompute L1", 0, 0.002), ("bwd.mlp L1", 0, 0.010), ("bwd.attention L1", 0, 0.010), ("h2d.weights L1", 0, 1.0),
            ("loss (LM head + cross-entropy) L2", 0, 0.003), ("bwd.embedding", 0, 0.002), ("fwd.embedding", 0, 0.004),
        ])

    def tearDown(self):
        self.dir.cleanup()

    def test_halves_and_passes_paired(self):
        rows = table(run([self.measured, "--layers"]))
        self.assertEqual(rows[("0", "fwd.attention")], (4.0, 2.0, 2.0))
        self.assertEqual(rows[("0", "fwd")], (10.0, 8.0, 1.25))  # the pass against the sum of its halves
        self.assertEqual(rows[("1", "bwd.mlp")], (12.0, 10.0, 1.2))
        self.assertEqual(rows[("1", "recompute")], (4.0, 2.0, 2.0))
        self.assertEqual(rows[("1", "recompute.mlp")], (3.0, None, None))  # the planner prices it whole
        self.assertNotIn(("0", "bwd"), rows)  # neither trace has it
        # Totals over the layers; the host track and other ops stay out.
        self.assertEqual(rows[("all", "fwd")], (22.0, 20.0, 1.1))
        self.assertEqual(rows[("all", "fwd.mlp")], (13.0, 13.0, 1.0))
        self.assertFalse(any("h2d" in op for _, op in rows))
        # The ends: the loss against the planner's loss op (its L<n> suffix), the embedding backward
        # against bwd.embedding, the forward only predicted; the host's "wait for the loss" left out.
        self.assertEqual(rows[("ends", "loss")], (9.0, 3.0, 3.0))
        self.assertEqual(rows[("ends", "embedding backward")], (1.0, 2.0, 0.5))
        self.assertEqual(rows[("ends", "embedding")], (None, 4.0, None))

    def test_totals_only_by_default(self):
        rows = table(run([self.measured]))
        self.assertTrue(rows and all(layer in ("all", "ends") for layer, _ in rows))

    def test_bad_input_named(self):
        for argv, says in (([os.path.join(self.dir.name, "none.json")], "no such file"),):
            with self.assertRaises(SystemExit) as e:
                tc.main(argv)
            self.assertIn(says, str(e.exception))
        empty = os.path.join(self.dir.name, "empty.json")
        trace(empty, [("h2d weights layers.0", 0, 1)])
        with self.assertRaises(SystemExit) as e:
            tc.main([empty, self.measured])
        self.assertIn("no decoder layer spans", str(e.exception))
        with self.assertRaises(SystemExit) as e:
            tc.main([self.measured, empty])
        self.assertIn("no decoder layer ops", str(e.exception))
        with self.assertRaises(SystemExit) as e:
            tc.main([os.path.join(self.dir.name, "trace-step-3.predicted.json")])
        self.assertIn("is the prediction", str(e.exception))
        broken = os.path.join(self.dir.name, "broken.json")
        with open(broken, "w", encoding="utf-8") as f:
            f.write("{not json")
        with self.assertRaises(SystemExit) as e:
            tc.main([broken, self.measured])
        self.assertIn("not a Chrome trace", str(e.exception))

    @unittest.skipUnless(OOM_TRAIN, "no oom-train binary given")
    def test_oom_train_host_traces(self):
        out = os.path.join(self.dir.name, "run")
        subprocess.run([OOM_TRAIN, "--backend", "host", "--steps", "2", "--trace-step", "2", "--checkpoint-every", "0",
                        "--out", out], check=True, stdout=subprocess.DEVNULL)
        rows = table(run([os.path.join(out, "trace-step-2.json"), "--layers"]))
        # The built-in model's 4 layers, each pass measured and predicted (the host executor times
        # whole passes only; the CUDA executor's halves are checked in test_cuda_causal_lm).
        for layer in range(4):
            for op in ("fwd", "bwd"):
                m, p, r = rows[(str(layer), op)]
                self.assertGreater(m, 0)
                self.assertGreater(p, 0)
            self.assertIsNotNone(rows[(str(layer), "fwd.attention")][1])


class TraceSummary(unittest.TestCase):
    """scripts/trace_summary.py: spans grouped by kind; a bad file is one line naming it, not a traceback."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.dir.cleanup()

    def summary(self, *paths):
        return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "trace_summary.py"), *paths],
                              capture_output=True, text=True)

    def test_grouped_by_kind(self):
        path = os.path.join(self.dir.name, "t.json")
        trace(path, [("fwd layers.0", 0.0, 0.010), ("fwd layers.1", 0.010, 0.020), ("loss", 0.03, 0.004)])
        r = self.summary(path)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"gpu_compute\s+fwd layers\.N\s+2 spans,\s+30\.000 ms, median\s+15\.000 ms")

    def test_bad_input_named(self):
        not_trace = os.path.join(self.dir.name, "config.json")
        with open(not_trace, "w", encoding="utf-8") as f:
            f.write('{"hidden_size": 64}')
        broken = os.path.join(self.dir.name, "broken.json")
        with open(broken, "w", encoding="utf-8") as f:
            f.write('{"traceEvents": [')
        for path, why in ((os.path.join(self.dir.name, "none.json"), "no such file"), (not_trace, "not a Chrome trace"),
                          (broken, "not JSON"), (self.dir.name, "")):
            r = self.summary(path)
            self.assertNotEqual(r.returncode, 0, path)
            self.assertNotIn("Traceback", r.stderr)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
            self.assertIn(f"trace_summary.py: {path}: {why}", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
