#!/usr/bin/env python3
"""The peer baseline: PyTorch FSDP2 training transformers' model of a config.json, timed the way
oom-train reports itself, so that OOM's figures can be read as ratios to a peer run on the same
machine in the same session (MISSION.md's peer table was measured this way: FSDP2, bf16 compute
over fp32 parameters, per-layer activation checkpointing, torch.optim.AdamW).

  python3 bench/baselines/fsdp2.py --config examples/configs/moe-5b.json --seq 4096 --batch 2 \
      [--offload] [--steps 4] [--json out.json]
  torchrun --nproc-per-node 2 bench/baselines/fsdp2.py ...     (several GPUs: batch per GPU)

Modes: plain FSDP2 (all state on the GPU) or --offload (CPUOffloadPolicy(pin_memory=True): fp32
parameters, gradients and AdamW state on the host, the optimizer step on the CPU). The model is
built and initialised on the GPU (transformers' init, std initializer_range), then sharded, one
FSDP unit per decoder layer and one for the rest. Each step is one forward and backward of
(batch, seq) tokens with oom-train's loss (mean cross-entropy of each window's tokens 1..seq given
0..seq-1, on fp32 logits as transformers computes it) and one AdamW step; the windows are random
tokens, or with --batches those of an oom-train run (its --dump-batches file), so both train on
the same data. Printed per step: loss, seconds, tokens/s (all GPUs together); then the mean over the
steps after the first (the first warms allocators and kernels) and the peaks: GPU memory reserved
by PyTorch's allocator (the most any rank reserved) and host RSS high-water mark (VmHWM) of rank
0. A run that does not fit prints 'out of GPU memory' (or host memory) and exits with status 3,
after writing the JSON with "error" set, so a sweep can go on to the next setting.
"""
import argparse
import json
import os
import sys
import time


def host_rss_peak_bytes():
    """VmHWM of this process (bytes), 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a Hugging Face config.json (a model transformers knows)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step on each GPU (default 1)")
    ap.add_argument("--steps", type=int, default=4, help="steps to run, the first not counted (default 4)")
    ap.add_argument("--offload", action="store_true", help="CPUOffloadPolicy: state and the optimizer on the host")
    ap.add_argument("--no-checkpointing", action="store_true", help="keep every activation (no per-layer recompute)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batches", help="train on these windows (an OOMTOK01 file of seq + 1 tokens each, as "
                    "oom-train --dump-batches writes; step i takes windows i*batch*gpus ...) instead of random tokens")
    ap.add_argument("--json", help="write the summary here (rank 0)")
    args = ap.parse_args(argv)
    for name in ("seq", "batch", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step is a warm-up and is not counted")
    for name in ("config", "batches"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            ap.error(f"--{name} {path}: no such file")
    return args


def config_fields(path, seq):
    """The config.json's fields for transformers.AutoConfig.for_model: (model_type, the rest). The
    dtype fields are dropped (parameters are fp32 here, the compute bf16 by the FSDP2 policy) and
    max_position_embeddings is raised to seq where it is smaller. A file without model_type, or that
    is not a JSON object, is refused naming the file."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"fsdp2 baseline: {path}: {e}")
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise SystemExit(f"fsdp2 baseline: {path}: no model_type field (not a Hugging Face config.json?)")
    raw = dict(raw)
    raw.pop("torch_dtype", None)
    raw.pop("dtype", None)
    if raw.get("max_position_embeddings", seq) < seq:
        raw["max_position_embeddings"] = seq
    return raw.pop("model_type"), raw


def step_windows(total_windows, seq, batch, gpus, steps):
    """How a token file of total_windows windows (of seq + 1 tokens) feeds the run: step i on rank r
    takes windows (i * gpus + r) * batch ... + batch. Refused, naming the counts, when the file is short."""
    need = steps * gpus * batch
    if total_windows < need:
        raise SystemExit(f"fsdp2 baseline: --batches holds {total_windows} windows of {seq + 1} tokens; {steps} steps "
                         f"of {batch} sequence(s) on {gpus} GPU(s) need {need}")
    return lambda step, rank: range((step * gpus + rank) * batch, (step * gpus + rank + 1) * batch)


def summarize(step_seconds, tokens_per_step):
    """Mean and range over the steps after the first: (mean s, min tok/s, max tok/s, mean tok/s)."""
    timed = step_seconds[1:]
    mean_s = sum(timed) / len(timed)
    rates = [tokens_per_step / s for s in timed]
    return mean_s, min(rates), max(rates), tokens_per_step / mean_s


def main(argv=None):
    args = parse_args(argv)
    model_type, fields = config_fields(args.config, args.seq)  # a bad file fails before torch starts
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not torch.cuda.is_available():
        sys.exit("fsdp2 baseline: no CUDA device; this baseline runs on the GPU machine")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    say = print if rank == 0 else (lambda *a, **k: None)

    config = transformers.AutoConfig.for_model(model_type, **fields)
    config.use_cache = False
    torch.manual_seed(args.seed)
    mode = "FSDP2 + CPU offload" if args.offload else "plain FSDP2"
    tokens = args.seq * args.batch * world
    result = {"peer": "fsdp2-offload" if args.offload else "fsdp2", "config": args.config, "seq": args.seq,
              "batch": args.batch, "gpus": world, "tokens_per_step": tokens,
              "checkpointing": not args.no_checkpointing, "torch": torch.__version__,
              "transformers": transformers.__version__, "device": torch.cuda.get_device_name()}

    def finish(code):
        result["host_rss_peak_bytes"] = host_rss_peak_bytes()
        peak = torch.tensor([float(torch.cuda.max_memory_reserved())], device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result["gpu_reserved_peak_bytes"] = int(peak.item())
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        dist.destroy_process_group()
        return code

    t0 = time.perf_counter()
    try:
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        model.float()
        params = sum(p.numel() for p in model.parameters())
        result["parameters"] = params
        say(f"{mode}: {config.model_type}, {params:,} parameters, seq {args.seq} x batch {args.batch} on {world} GPU(s); "
            f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
        if not args.no_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=True) if args.offload else OffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, foreach=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        say(f"built and sharded in {time.perf_counter() - t0:.1f} s", flush=True)

        gen = torch.Generator(device="cuda").manual_seed(args.seed + rank)
        if args.batches:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
            from compare_train_pytorch import read_tokens
            flat = read_tokens(args.batches)
            if flat.size % (args.seq + 1):
                raise SystemExit(f"fsdp2 baseline: {args.batches}: {flat.size} tokens are not windows of seq + 1 = {args.seq + 1}")
            windows = torch.from_numpy(flat.reshape(-1, args.seq + 1))
            pick = step_windows(windows.shape[0], args.seq, args.batch, world, args.steps)
            result["batches"] = args.batches
        step_seconds = []
        for step in range(1, args.steps + 1):
            if args.batches:  # oom-train's loss: window[1:] given window[:-1]
                w = windows[list(pick(step - 1, rank))].to("cuda")
            else:
                w = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device="cuda", generator=gen)
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            logits = model(input_ids=w[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            dist.barrier()
            seconds = time.perf_counter() - start
            step_seconds.append(seconds)
            say(f"step {step:4d}/{args.steps} | loss {loss.item():.4f} | {seconds:.3f} s | {tokens / seconds:,.0f} tok/s",
                flush=True)
    except torch.cuda.OutOfMemoryError as e:
        say(f"{mode}: out of GPU memory at seq {args.seq} x batch {args.batch}: {str(e).splitlines()[0]}")
        result["error"] = "out of GPU memory"
        return finish(3)
    except MemoryError:
        say(f"{mode}: out of host memory at seq {args.seq} x batch {args.batch}")
        result["error"] = "out of host memory"
        return finish(3)

    mean_s, low, high, mean_rate = summarize(step_seconds, tokens)
    result.update(step_seconds=step_seconds, mean_step_s=mean_s, tokens_per_s=mean_rate,
                  tokens_per_s_range=[low, high])
    code = finish(0)
    say(f"{mode}, seq {args.seq} x batch {args.batch} x {world} GPU(s), steps 2-{args.steps}: {mean_s:.3f} s a step, "
        f"{mean_rate:,.0f} tok/s ({low:,.0f}-{high:,.0f}); GPU reserved peak "
        f"{result['gpu_reserved_peak_bytes'] / 2**30:.1f} GiB, host RSS peak {result['host_rss_peak_bytes'] / 2**30:.1f} GiB")
    return code


if __name__ == "__main__":
    sys.exit(main())
