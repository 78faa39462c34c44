#!/usr/bin/env python3
"""The rounding emulation (scripts/diag/emulate_layer_rounding.py): its run syntax and its points
without torch; with torch (not in CI), a small layer end to end: no rounding reproduces the
reference exactly, every rounding moves every tensor by a bf16-sized amount, and a run without the
forward's roundings leaves the output exact.
Usage: test_emulate_layer_rounding.py REPO_ROOT"""
import os
import re
import sys
import unittest

REPO = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "scripts", "diag"))
import emulate_layer_rounding as emu  # noqa: E402  (stdlib imports only at module level)

try:
    import torch
except ImportError:
    torch = None


class Runs(unittest.TestCase):
    def test_named_runs(self):
        runs = dict(emu.parse_runs("all; forward ;backward;none"))
        self.assertEqual(runs["all"], emu.POINTS)
        self.assertEqual(runs["forward"], frozenset(emu.FORWARD))
        self.assertEqual(runs["backward"], frozenset(emu.BACKWARD))
        self.assertEqual(runs["none"], frozenset())
        self.assertEqual(emu.POINTS, frozenset(emu.FORWARD) | frozenset(emu.BACKWARD))
        self.assertFalse(set(emu.FORWARD) & set(emu.BACKWARD))

    def test_all_but(self):
        (label, on), = emu.parse_runs("all-h,xn2_router")
        self.assertEqual(label, "all-h,xn2_router")
        self.assertEqual(on, emu.POINTS - {"h", "xn2_router"})

    def test_refusals_name_the_problem(self):
        with self.assertRaisesRegex(SystemExit, r"unknown rounding point\(s\) \['hh'\]"):
            emu.parse_runs("all-hh,xn2")
        with self.assertRaisesRegex(SystemExit, "'most' is not all, forward"):
            emu.parse_runs("most")
        with self.assertRaisesRegex(SystemExit, "names no run"):
            emu.parse_runs(" ; ")

    def test_every_point_is_used_by_the_layer_and_every_used_name_is_a_point(self):
        with open(emu.__file__) as f:
            src = f.read()
        # every quoted plain name on a line that rounds (weight names have dots, so they do not match)
        names = {n for line in src.splitlines() if "rnd(" in line or "rnd_grad(" in line or '" in on' in line
                 for n in re.findall(r'"(\w+)"', line)}
        self.assertEqual(names, set(emu.POINTS))


@unittest.skipUnless(torch is not None, "torch is not installed here (the emulation itself needs it)")
class SmallLayer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cdl = emu.load_compare_script()
        cfg = cdl.layer_config(48)
        runs = emu.parse_runs("none;all;backward")
        lines = []
        cls.status, cls.errs = emu.emulate(torch, cdl, cfg, 48, 0, False, "fp32", runs,
                                           out=lambda *a, **k: lines.append(" ".join(map(str, a))))
        cls.lines = lines

    def test_runs(self):
        self.assertEqual(self.status, 0, "\n".join(self.lines))
        self.assertEqual(set(self.errs), {"none", "all", "backward"})

    def test_no_rounding_is_the_reference(self):
        self.assertTrue(all(e == 0.0 for e in self.errs["none"].values()), self.errs["none"])

    def test_every_rounding_moves_every_tensor_by_bf16_noise(self):
        for name, e in self.errs["all"].items():
            self.assertGreater(e, 1e-5, name)
            self.assertLess(e, 5e-2, name)

    def test_backward_roundings_leave_the_output_exact(self):
        self.assertEqual(self.errs["backward"]["output"], 0.0)
        self.assertGreater(self.errs["backward"]["grad_input"], 0.0)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
