#!/usr/bin/env python3
"""The peer baselines' parts that run without a GPU or torch (bench/baselines/common.py, fsdp2.py,
deepspeed_offload.py): their arguments, the config they hand transformers and DeepSpeed, how a
token file feeds the steps, and the figure they report.
With torch and transformers, the FSDP2 baseline also runs on the CPU, and given oom-train it trains
from oom-train's initial weights on its windows to oom-train's losses.
Usage: test_peer_baselines.py REPO_ROOT [OOM_TRAIN]"""
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

REPO = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
OOM_TRAIN = sys.argv.pop(1) if len(sys.argv) > 1 else None
sys.path.insert(0, os.path.join(REPO, "bench", "baselines"))
import common as bench  # noqa: E402  (stdlib imports only at module level)
import deepspeed_offload  # noqa: E402
import fsdp2  # noqa: E402
import summary  # noqa: E402

MOE_5B = os.path.join(REPO, "examples", "configs", "moe-5b.json")


def refused(fn, *args):
    """The message of the SystemExit fn raises (argparse's goes to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            fn(*args)
        except SystemExit as e:
            return f"{e.code if isinstance(e.code, str) else ''}{err.getvalue()}"
    raise AssertionError(f"{fn.__name__}{args} was not refused")


class Arguments(unittest.TestCase):
    def test_defaults(self):
        a = fsdp2.parse_args(["--config", MOE_5B])
        self.assertEqual((a.seq, a.batch, a.steps, a.offload, a.no_checkpointing, a.device),
                         (4096, 1, 4, False, False, "cuda"))
        self.assertTrue(fsdp2.parse_args(["--config", MOE_5B, "--offload"]).offload)

    def test_one_step_is_refused_since_the_first_is_not_counted(self):
        self.assertIn("--steps must be at least 2", refused(fsdp2.parse_args, ["--config", MOE_5B, "--steps", "1"]))

    def test_zero_batch_and_seq_are_refused(self):
        self.assertIn("--batch must be at least 1", refused(fsdp2.parse_args, ["--config", MOE_5B, "--batch", "0"]))
        self.assertIn("--seq must be at least 1", refused(fsdp2.parse_args, ["--config", MOE_5B, "--seq", "0"]))

    def test_missing_files_are_named(self):
        self.assertIn("nope.json: no such file", refused(fsdp2.parse_args, ["--config", "nope.json"]))
        self.assertIn("--batches nope.tok: no such file",
                      refused(fsdp2.parse_args, ["--config", MOE_5B, "--batches", "nope.tok"]))


class DeepSpeedConfig(unittest.TestCase):
    def test_stage_2_offloads_the_optimizer_only(self):
        args = deepspeed_offload.parse_args(["--config", MOE_5B, "--batch", "3", "--lr", "1e-4"])
        self.assertEqual(args.stage, 2)
        cfg = deepspeed_offload.ds_config(args, args.stage)
        self.assertEqual(cfg["train_micro_batch_size_per_gpu"], 3)
        self.assertEqual(cfg["gradient_accumulation_steps"], 1)
        self.assertTrue(cfg["bf16"]["enabled"])
        zero = cfg["zero_optimization"]
        self.assertEqual((zero["stage"], zero["offload_optimizer"]["device"]), (2, "cpu"))
        self.assertTrue(zero["offload_optimizer"]["pin_memory"])
        self.assertNotIn("offload_param", zero)
        self.assertEqual(cfg["optimizer"]["type"], "AdamW")
        self.assertEqual((cfg["optimizer"]["params"]["lr"], cfg["optimizer"]["params"]["weight_decay"]), (1e-4, 0.01))
        self.assertEqual(cfg["gradient_clipping"], 0.0)  # oom-train's default: no clipping

    def test_stage_3_offloads_the_parameters_too(self):
        args = deepspeed_offload.parse_args(["--config", MOE_5B, "--stage", "3"])
        zero = deepspeed_offload.ds_config(args, args.stage)["zero_optimization"]
        self.assertEqual((zero["stage"], zero["offload_param"]["device"]), (3, "cpu"))

    def test_other_stages_are_refused(self):
        self.assertIn("invalid choice", refused(deepspeed_offload.parse_args, ["--config", MOE_5B, "--stage", "1"]))


class ConfigFields(unittest.TestCase):
    def test_the_benchmark_model(self):
        model_type, fields = bench.config_fields(MOE_5B, 4096)
        self.assertEqual(model_type, "qwen3_moe")
        self.assertNotIn("model_type", fields)
        self.assertNotIn("torch_dtype", fields)  # fp32 parameters whatever the file says
        self.assertEqual((fields["hidden_size"], fields["num_experts"], fields["num_experts_per_tok"]), (2048, 64, 8))
        self.assertEqual(fields["max_position_embeddings"], 1048576)  # already long enough: unchanged

    def test_a_sequence_longer_than_the_table_raises_it(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "c.json")
            with open(path, "w") as f:
                json.dump({"model_type": "qwen3_moe", "max_position_embeddings": 4096, "dtype": "bfloat16"}, f)
            model_type, fields = bench.config_fields(path, 131072)
            self.assertEqual(fields, {"max_position_embeddings": 131072})

    def test_bad_files_are_named(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "c.json")
            with open(path, "w") as f:
                f.write('{"hidden_size": 8}')
            self.assertIn(f"{path}: no model_type field", refused(bench.config_fields, path, 8))
            with open(path, "w") as f:
                f.write("[1, 2")
            self.assertIn(path, refused(bench.config_fields, path, 8))


class StepWindows(unittest.TestCase):
    def test_as_oom_train_dumps_them_one_step_after_another(self):
        pick = bench.step_windows(12, 4096, 3, 1, 4)
        self.assertEqual([list(pick(i, 0)) for i in range(4)], [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]])

    def test_ranks_take_disjoint_windows(self):
        pick = bench.step_windows(16, 128, 2, 2, 4)
        seen = [w for i in range(4) for r in range(2) for w in pick(i, r)]
        self.assertEqual(sorted(seen), list(range(16)))
        self.assertEqual(list(pick(1, 1)), [6, 7])

    def test_a_short_file_is_refused_with_the_counts(self):
        msg = refused(bench.step_windows, 11, 4096, 3, 1, 4)
        self.assertIn("holds 11 windows of 4097 tokens", msg)
        self.assertIn("need 12", msg)


class Summary(unittest.TestCase):
    def test_the_first_step_is_left_out_and_the_rate_is_tokens_over_mean_time(self):
        mean_s, low, high, rate = bench.summarize([9.0, 1.0, 2.0, 1.0], 4000)
        self.assertAlmostEqual(mean_s, 4.0 / 3.0)
        self.assertAlmostEqual(rate, 3000.0)  # not the mean of the per-step rates (3333)
        self.assertEqual((low, high), (2000.0, 4000.0))


    def test_a_skipped_oom_step_gives_no_rate(self):
        # A skipped step has no backward and no update: its time is not a step's.
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "m.jsonl")
            step = {"tokens": 4096, "step_s": 0.1, "device_peak_bytes": 1, "host_rss_bytes": 1, "skipped": False}
            with open(path, "w") as f:
                for k in range(3):
                    f.write(json.dumps({**step, "step": k + 1}) + "\n")
            self.assertAlmostEqual(summary.oom_figures(path)[0], 40960.0)
            with open(path, "a") as f:
                f.write(json.dumps({**step, "step": 4, "step_s": 0.01, "skipped": True}) + "\n")
            self.assertIsNone(summary.oom_figures(path)[0])


class TheTrainingStep(unittest.TestCase):
    """What the peers train is what oom-train trains: its weight decay, and the router's load-balancing
    loss where the config asks for it (transformers adds it only given labels, which the peers do not pass)."""

    def test_weight_decay_is_oom_trains(self):
        self.assertEqual(fsdp2.parse_args(["--config", MOE_5B]).weight_decay, 0.01)
        self.assertEqual(fsdp2.parse_args(["--config", MOE_5B]).optimizer, "fused")

    def test_the_router_loss_weight_follows_output_router_logits(self):
        from types import SimpleNamespace
        self.assertEqual(bench.router_aux_coef(SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.01)), 0.01)
        self.assertEqual(bench.router_aux_coef(SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.01)), 0.0)
        self.assertEqual(bench.router_aux_coef(SimpleNamespace(router_aux_loss_coef=0.01)), 0.0)

    def test_init_from_needs_a_checkpoint_directory(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertIn("not a checkpoint directory", refused(fsdp2.parse_args, ["--config", MOE_5B, "--init-from", d]))


class WatchingTheResidentSet(unittest.TestCase):
    """common.RssWatch: the high-water mark on disk while the process runs, growing with it."""

    def test_the_file_follows_the_high_water_mark(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.json.rss")

            def written():
                with open(path) as f:
                    return int(f.read())
            watch = bench.RssWatch(path, period=0.05).start()
            first = written()
            self.assertGreater(first, 0)
            self.assertLessEqual(first, bench.host_rss_peak_bytes() + 8 * 2**20)
            grown = bytearray(256 * 2**20)  # touched: 256 MiB more resident
            for i in range(0, len(grown), 4096):
                grown[i] = 1
            deadline = time.time() + 5
            while written() < first + 200 * 2**20 and time.time() < deadline:
                time.sleep(0.05)
            self.assertGreaterEqual(written(), first + 200 * 2**20)  # written by the thread, unasked
            del grown
            watch.stop()
            # A high-water mark: freeing the memory does not lower it.
            self.assertGreaterEqual(written(), first + 200 * 2**20)
            # (VmHWM is read from per-CPU counters that lag by a few pages: a little slack.)
            self.assertLessEqual(written(), bench.host_rss_peak_bytes() + 8 * 2**20)
            self.assertFalse(os.path.exists(path + ".tmp"))


class PeerTable(unittest.TestCase):
    """bench/baselines/summary.py on a folder as PARTS=peers leaves it."""

    @staticmethod
    def write(d, name, text):
        with open(os.path.join(d, name), "w") as f:
            f.write(text)

    def folder(self, d):
        # oom-train: 3 steps of 8192 tokens; the first (slow) is left out: 2 x 8192 / (0.5 + 0.3) = 20480.
        steps = [{"tokens": 8192, "step_s": s, "device_peak_bytes": p * 2**30, "host_rss_bytes": 2**30,
                  "host_rss_peak_bytes": 3 * 2**30} for s, p in ((4.0, 90), (0.5, 96), (0.3, 95))]
        self.write(d, "peer-oom-4096-2.jsonl", "".join(json.dumps(x) + "\n" for x in steps))
        self.write(d, "peer-run-plain-4096-2.log", "")
        self.write(d, "peer-run-plain-4096-2.json", json.dumps(
            {"label": "plain FSDP2", "tokens_per_s": 5120.0, "gpu_reserved_peak_bytes": 100 * 2**30,
             "host_rss_peak_bytes": 2 * 2**30, "batches": "x.tok"}))
        self.write(d, "peer-run-deepspeed-zero3-4096-2.log", "")
        self.write(d, "peer-run-deepspeed-zero3-4096-2.rc", "124\n")
        self.write(d, "peer-run-offload-nockpt-4096-2.log", "")
        self.write(d, "peer-run-offload-nockpt-4096-2.rc", "1\n")
        self.write(d, "peer-run-deepspeed-4096-2.log", "")
        self.write(d, "peer-run-deepspeed-4096-2.json", json.dumps({"error": "out of GPU memory"}))
        self.write(d, "peer-run-plain-nockpt-4096-2.log", "")  # its JSON's label may lack the mode's suffix
        self.write(d, "peer-run-plain-nockpt-4096-2.json", json.dumps({"label": "plain FSDP2", "tokens_per_s": 6000.0}))
        self.write(d, "peer-run-plain-1024-1.log", "")  # no oom-train run at that setting: no row

    def test_rows_ratios_and_why_a_peer_has_no_figure(self):
        with tempfile.TemporaryDirectory() as d:
            self.folder(d)
            rows = {r["mode"]: r for r in summary.peer_rows(d)}
            self.assertEqual(set(rows), {"plain", "plain-nockpt", "deepspeed", "deepspeed-zero3", "offload-nockpt"})
            self.assertEqual(rows["plain-nockpt"]["label"], "plain FSDP2 (no activation checkpointing)")
            plain = rows["plain"]
            self.assertAlmostEqual(plain["ours"], 20480.0)
            self.assertEqual((plain["ours_gpu"], plain["ours_host"]), (96 * 2**30, 3 * 2**30))
            self.assertEqual(plain["data"], "same windows")
            self.assertIn("not finished", rows["deepspeed-zero3"]["error"])
            self.assertEqual(rows["deepspeed-zero3"]["label"], "DeepSpeed ZeRO-Infinity (CPU)")
            self.assertIn("failed, exit 1", rows["offload-nockpt"]["error"])
            self.assertEqual(rows["offload-nockpt"]["label"], "FSDP2 + CPU offload (no activation checkpointing)")
            self.assertEqual(rows["deepspeed"]["error"], "out of GPU memory")
            lines = summary.format_rows(summary.peer_rows(d))
            self.assertIn("seq 4096 x batch 2: OOM 20,480 vs plain FSDP2 5,120 = 4.00x; GPU 96.0 vs 100.0, "
                          "host 3.0 vs 2.0; same windows", lines)
            self.assertIn("seq 4096 x batch 2: OOM 20,480; DeepSpeed ZeRO-Offload: out of GPU memory", lines)
            self.assertEqual(len(lines), 5)

    def test_a_kill_inside_the_time_limit_is_told_from_a_time_cut(self):
        with tempfile.TemporaryDirectory() as d:
            def why(text):
                self.write(d, "x.rc", text)
                return summary.why_no_result(os.path.join(d, "x.rc"), "x.log")
            self.assertEqual(why("137 130 420\n"), "killed (SIGKILL) after 130 s, inside its 420 s limit: not a time "
                                                   "cut, likely the host's out-of-memory killer (x.log)")
            self.assertEqual(why("137 412 420\n"), "killed (SIGKILL) after 412 s, inside its 420 s limit: not a time "
                                                   "cut, likely the host's out-of-memory killer (x.log)")
            self.assertEqual(why("137 430 420\n"), "not finished: cut by its time limit (x.log)")  # KILL 10 s after the TERM
            self.assertEqual(why("124 420 420\n"), "not finished: cut by its time limit (x.log)")
            self.assertEqual(why("137 419 420\n"), "not finished: cut by its time limit (x.log)")  # the clock's rounding
            self.assertEqual(why("124 0 0\n"), "not run: the call's time budget was spent (x.log)")
            self.assertEqual(why("137\n"), "not finished: skipped or cut by its time limit (x.log)")  # older runs
            self.assertEqual(why("2 5 420\n"), "failed, exit 2, no result (x.log)")
            # What the run's RssWatch last wrote: how far it had got.
            self.write(d, "x.json.rss", f"{int(123.5 * 2**30)}\n")
            self.write(d, "x.rc", "137 130 420\n")
            self.assertEqual(summary.why_no_result(os.path.join(d, "x.rc"), "x.log", os.path.join(d, "x.json.rss")),
                             "killed (SIGKILL) after 130 s, inside its 420 s limit: not a time cut, likely the host's "
                             "out-of-memory killer, its host RSS at least 123.5 GiB (x.log)")
            self.assertEqual(summary.why_no_result(os.path.join(d, "none.rc"), "x.log"), "failed, exit ?, no result (x.log)")


@unittest.skipUnless(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"),
                     "torch and transformers are not installed here: the baseline's run on the CPU is not tried")
class RunOnTheCpu(unittest.TestCase):
    def run_fsdp2(self, **env):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            keep = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE") + bench.ALLOC_CONF_NAMES}
            proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "baselines", "fsdp2.py"), "--config",
                                   os.path.join(REPO, "examples", "configs", "tiny-moe-d128.json"), "--seq", "32",
                                   "--steps", "2", "--device", "cpu", "--json", out], capture_output=True, text=True,
                                  timeout=300, env={**keep, **env})
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            return json.load(open(out))

    def test_fsdp2_two_steps_of_the_tiny_model(self):
        result = self.run_fsdp2()
        self.assertEqual((result["peer"], result["seq"], result["tokens_per_step"]), ("fsdp2", 32, 32))
        self.assertEqual(len(result["step_seconds"]), 2)
        self.assertGreater(result["tokens_per_s"], 0)
        # The peer runs with PyTorch's own advice against fragmentation unless the caller says otherwise.
        self.assertEqual(result["alloc_conf"], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})

    @unittest.skipUnless(OOM_TRAIN, "no oom-train given: the peer is not trained against it")
    def test_from_oom_trains_initial_weights_the_peer_trains_oom_trains_losses(self):
        # The same weights (oom-train --save-initial, the peer's --init-from), the same windows
        # (--dump-batches, --batches), the router's load-balancing loss in both: the same steps,
        # up to the peer's bf16 compute against oom-train's fp32 host backend.
        config = os.path.join(REPO, "tests", "data", "tiny-olmoe-router-loss.json")
        with tempfile.TemporaryDirectory() as d:
            run = os.path.join(d, "run")
            subprocess.run([OOM_TRAIN, "--backend", "host", "--config", config, "--seq", "32", "--batch", "2", "--steps", "4",
                            "--lr", "3e-4", "--log-every", "1", "--checkpoint-every", "0", "--save-initial",
                            "--dump-batches", os.path.join(d, "run.tok"), "--out", run], check=True, capture_output=True)
            ours = [json.loads(line)["loss"] for line in open(os.path.join(run, "metrics.jsonl"))]
            out = os.path.join(d, "peer.json")
            keep = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE") + bench.ALLOC_CONF_NAMES}
            proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "baselines", "fsdp2.py"), "--config", config,
                                   "--seq", "32", "--batch", "2", "--steps", "4", "--device", "cpu", "--batches",
                                   os.path.join(d, "run.tok"), "--init-from", os.path.join(run, "checkpoint-000000"),
                                   "--json", out], capture_output=True, text=True, timeout=300, env=keep)
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            theirs = [float(line.split("| loss ")[1].split()[0]) for line in proc.stdout.splitlines() if "| loss " in line]
            self.assertEqual(len(theirs), 4)
            self.assertGreater(ours[0], 6.0)  # ln 256 = 5.55 plus the load-balancing loss: the peer must add it too
            for a, b in zip(ours, theirs):
                self.assertAlmostEqual(a, b, delta=2e-3)
            self.assertEqual(json.load(open(out))["router_aux_loss_coef"] > 0, True)

    def test_the_callers_allocator_setting_stands_under_either_name(self):
        for name in bench.ALLOC_CONF_NAMES:
            with self.subTest(name=name):
                result = self.run_fsdp2(**{name: "expandable_segments:False"})
                self.assertEqual(result["alloc_conf"], {name: "expandable_segments:False"})

    def test_token_loss_is_the_fp32_cross_entropy_of_the_next_token(self):
        import torch
        gen = torch.Generator().manual_seed(3)
        logits = torch.randn(2, 5, 11, generator=gen).to(torch.bfloat16)
        targets = torch.randint(0, 11, (2, 5), generator=gen)
        loss = bench.token_loss(logits, targets)
        self.assertEqual(loss.dtype, torch.float32)
        # By hand, in fp64 from the same bf16 values: mean over tokens of logsumexp - the target's logit.
        x = logits.double().reshape(-1, 11)
        want = (torch.logsumexp(x, dim=1) - x[torch.arange(10), targets.reshape(-1)]).mean()
        self.assertAlmostEqual(loss.item(), want.item(), places=5)

    def test_token_loss_keeps_no_logits_alive(self):
        # The step loop passes the forward's logits straight in: once the loss is made nothing but
        # the graph may hold them, and the graph of a projection does not (8 GiB at 128K).
        import gc
        import weakref
        import torch
        x = torch.randn(10, 4, requires_grad=True)
        w = torch.randn(4, 11).to(torch.bfloat16)
        held = []

        def forward():
            out = (x.to(torch.bfloat16) @ w).reshape(2, 5, 11)
            held.append(weakref.ref(out))
            return out
        loss = bench.token_loss(forward(), torch.randint(0, 11, (2, 5)))
        gc.collect()
        self.assertIsNone(held[0]())
        loss.backward()
        self.assertEqual(x.grad.shape, (10, 4))


if __name__ == "__main__":
    unittest.main(verbosity=2)
