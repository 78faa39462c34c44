"""What the peer baselines share (bench/baselines/fsdp2.py, deepspeed_offload.py): the arguments,
the model from a config.json, the data (random tokens or an oom-train run's windows), oom-train's
loss, the timing and the summary. Each baseline supplies only how it wraps the model and takes a
step. Standard library only at module level, so the CI tests run without torch.

A run prints per step: loss, seconds, tokens/s (all GPUs together); then the mean over the steps
after the first (the first warms allocators and kernels) and the peaks: GPU memory reserved by
PyTorch's allocator (the most any rank reserved) and the host RSS high-water mark (VmHWM) of rank
0. A run that does not fit prints 'out of GPU memory' (or host memory) and exits with status 3,
after writing the JSON with "error" set, so that a sweep goes on to the next setting.
"""
import argparse
import json
import os
import sys
import threading
import time


# What each baseline mode is called, in its output and in the peers' table (bench/baselines/summary.py).
LABELS = {"plain": "plain FSDP2", "offload": "FSDP2 + CPU offload", "deepspeed": "DeepSpeed ZeRO-Offload",
          "deepspeed-zero3": "DeepSpeed ZeRO-Infinity (CPU)"}


def mode_label(mode):
    """The label of a mode as PARTS=peers names it: a LABELS key, "-nockpt" added without checkpointing."""
    base = mode.removesuffix("-nockpt")
    return LABELS.get(base, mode) + (" (no activation checkpointing)" if base != mode else "")


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


class RssWatch:
    """Writes this process's resident-set high-water mark (VmHWM, bytes, as decimal text) to `path`
    whenever it has grown, every `period` seconds, from a daemon thread; and once more on stop().
    A peer that outgrows the host's memory is SIGKILLed by the kernel with no Python error and no
    JSON: this file then says how far it had got (at most one period late). Rank 0 only."""

    def __init__(self, path, period=0.5):
        self.path, self.period, self.last = path, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-watch", daemon=True)

    def start(self):
        self.sample()
        self._thread.start()
        return self

    def sample(self):
        peak = host_rss_peak_bytes()
        if peak > self.last:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{peak}\n")
            os.replace(tmp, self.path)  # a reader never sees half a number
            self.last = peak

    def _loop(self):
        while not self._stop.wait(self.period):
            self.sample()

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()


def parse_args(description, argv=None, extra=None):
    """The common arguments, plus the baseline's own (extra(ap) adds them)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a Hugging Face config.json (a model transformers knows)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step on each GPU (default 1)")
    ap.add_argument("--steps", type=int, default=4, help="steps to run, the first not counted (default 4)")
    ap.add_argument("--no-checkpointing", action="store_true", help="keep every activation (no per-layer recompute)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's decoupled weight decay (default 0.01: "
                    "oom-train's)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batches", help="train on these windows (an OOMTOK01 file of seq + 1 tokens each, as "
                    "oom-train --dump-batches writes; step i takes windows i*batch*gpus ...) instead of random tokens")
    ap.add_argument("--init-from", help="start from these weights: an oom-train checkpoint directory (oom-train "
                    "--save-initial writes checkpoint-000000), read by transformers' from_pretrained (every parameter, "
                    "packed experts converted as from the Hub), so both start from the same draw; it is read on the "
                    "host, which then counts in the host high-water mark")
    ap.add_argument("--json", help="write the summary here (rank 0)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the run's logic on the CPU with gloo, for tests of the script (its times mean nothing)")
    if extra:
        extra(ap)
    args = ap.parse_args(argv)
    for name in ("seq", "batch", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step is a warm-up and is not counted")
    if args.init_from is not None and not os.path.isfile(os.path.join(args.init_from, "model.safetensors")):
        ap.error(f"--init-from {args.init_from}: not a checkpoint directory (no model.safetensors in it)")
    for name in ("config", "batches"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            ap.error(f"--{name.replace('_', '-')} {path}: no such file")
    return args


def config_fields(path, seq):
    """The config.json's fields for transformers.AutoConfig.for_model: (model_type, the rest). The
    dtype fields are dropped (parameters are built fp32; the baseline's mixed precision computes in
    bf16) and max_position_embeddings is raised to seq where it is smaller. A file without
    model_type, or that is not a JSON object, is refused naming the file."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"peer baseline: {path}: {e}")
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise SystemExit(f"peer baseline: {path}: no model_type field (not a Hugging Face config.json?)")
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
        raise SystemExit(f"peer baseline: --batches holds {total_windows} windows of {seq + 1} tokens; {steps} steps "
                         f"of {batch} sequence(s) on {gpus} GPU(s) need {need}")
    return lambda step, rank: range((step * gpus + rank) * batch, (step * gpus + rank + 1) * batch)


def summarize(step_seconds, tokens_per_step):
    """Mean and range over the steps after the first: (mean s, min tok/s, max tok/s, mean tok/s)."""
    timed = step_seconds[1:]
    mean_s = sum(timed) / len(timed)
    rates = [tokens_per_step / s for s in timed]
    return mean_s, min(rates), max(rates), tokens_per_step / mean_s


# The names torch reads its allocator settings from (the first wins; PYTORCH_ALLOC_CONF since 2.9).
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def token_loss(logits, targets):
    """oom-train's loss: the mean cross-entropy of window[1:] given window[:-1], on fp32 logits. The
    logits die with this call, so only the graph holds what the backward needs (a name kept across
    the step held the bf16 logits, 8 GiB at 128K, into the next step's forward)."""
    import torch
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def step_loss(output, targets, aux_coef):
    """oom-train's loss of one step from the model's output: token_loss, plus aux_coef times
    transformers' load-balancing loss where the config asks for it (output_router_logits: oom-train
    adds router_aux_loss_coef x the same loss; transformers adds it only when given labels, which
    the peers do not pass). The output dies with this call, as token_loss's logits do."""
    loss = token_loss(output.logits, targets)
    aux = getattr(output, "aux_loss", None)
    if aux_coef and aux is None:
        raise SystemExit("peer baseline: the config asks for the router's load-balancing loss, and the model returned none")
    return loss + aux_coef * aux if aux_coef else loss


def router_aux_coef(config):
    """The weight of the load-balancing loss in the training loss: router_aux_loss_coef where
    output_router_logits is set (as transformers and oom-train read the config), else 0."""
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if getattr(config, "output_router_logits", False) else 0.0


def run(args, peer, mode, prepare, info=None):
    """Builds the model of args.config on the GPU (fp32, transformers' init), lets prepare(model,
    world, device) wrap it and return (forward, update) -- forward(input_ids) gives the model's output, update(loss)
    runs the backward and the optimizer step -- and times args.steps steps. `peer` names the
    baseline in the JSON, `mode` (a LABELS key) its label in the output; `info` adds fields to the
    JSON. Returns the exit status (0, or 3 when out of memory)."""
    label = mode_label(mode + ("-nockpt" if args.no_checkpointing else ""))
    model_type, fields = config_fields(args.config, args.seq)  # a bad file fails before torch starts
    watch = RssWatch(args.json + ".rss").start() if args.json and os.environ.get("RANK", "0") == "0" else None
    try:
        return _start(args, peer, label, prepare, info, model_type, fields)
    finally:
        if watch:
            watch.stop()


def _start(args, peer, label, prepare, info, model_type, fields):
    """run() from torch's import on."""
    # PyTorch's advice when reserved-but-unallocated memory is what runs out (plain FSDP2 at 128K
    # failed so at step 2 with 17 GiB reserved and free): the peer as a user would tune it. A
    # setting of the caller's own, under either name torch reads, stands; the JSON records which ran.
    if not any(name in os.environ for name in ALLOC_CONF_NAMES):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit(f"{peer}: no CUDA device; this baseline runs on the GPU machine")
    if "WORLD_SIZE" not in os.environ:  # one process, not under torchrun: a free port of its own
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    world = int(os.environ["WORLD_SIZE"])
    windows = pick = None
    if args.batches:  # read before anything starts: a short or malformed file fails at once
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
        from compare_train_pytorch import read_tokens
        flat = read_tokens(args.batches)
        if flat.size % (args.seq + 1):
            sys.exit(f"{peer}: {args.batches}: {flat.size} tokens are not windows of seq + 1 = {args.seq + 1}")
        windows = flat.reshape(-1, args.seq + 1)
        pick = step_windows(windows.shape[0], args.seq, args.batch, world, args.steps)

    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    try:
        return _run(args, peer, label, prepare, info, model_type, fields, windows, pick)
    finally:
        dist.destroy_process_group()


def _run(args, peer, label, prepare, info, model_type, fields, windows, pick):
    """run() once the process group is up: the model, the steps, the summary."""
    import torch
    import torch.distributed as dist
    import transformers

    rank, world = dist.get_rank(), dist.get_world_size()
    device, cuda = args.device, args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()
    say = print if rank == 0 else (lambda *a, **k: None)

    config = transformers.AutoConfig.for_model(model_type, **fields)
    config.use_cache = False
    torch.manual_seed(args.seed)
    tokens = args.seq * args.batch * world
    result = {"peer": peer, "label": label, "config": args.config, "seq": args.seq, "batch": args.batch, "gpus": world,
              "tokens_per_step": tokens, "checkpointing": not args.no_checkpointing, "torch": torch.__version__,
              "transformers": transformers.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "alloc_conf": {name: os.environ[name] for name in ALLOC_CONF_NAMES if name in os.environ}, **(info or {})}

    def finish(code):
        result["host_rss_peak_bytes"] = host_rss_peak_bytes()
        # Reserved (what the allocator held from the GPU: OOM's arena peak is its like) and
        # allocated (what tensors used of it) peaks, the most any rank reached.
        peaks = [float(torch.cuda.max_memory_reserved()), float(torch.cuda.max_memory_allocated())] if cuda else [0.0, 0.0]
        if code == 0 and world > 1:  # after a failure the other ranks may be inside a collective
            t = torch.tensor(peaks, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peaks = t.tolist()
        result["gpu_reserved_peak_bytes"] = int(peaks[0])
        result["gpu_allocated_peak_bytes"] = int(peaks[1])
        # Rank 0 writes it; a rank that failed writes its own failure (torchrun then stops the others).
        if args.json and (rank == 0 or code != 0):
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return code

    if args.batches:
        result["batches"] = args.batches
    t0 = time.perf_counter()
    try:
        if args.init_from:  # every weight from the file (a missing or misshapen one is an error), then to the device
            model = transformers.AutoModelForCausalLM.from_pretrained(args.init_from, config=config, dtype=torch.float32)
            model.to(device)
            result["init_from"] = args.init_from
        else:
            with torch.device(device):
                model = transformers.AutoModelForCausalLM.from_config(config)
        model.float()
        result["parameters"] = params = sum(p.numel() for p in model.parameters())
        say(f"{label}: {config.model_type}, {params:,} parameters, seq {args.seq} x batch {args.batch} on {world} GPU(s); "
            f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
        if not args.no_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers' newer name, every layer
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        forward, update = prepare(model, world, device)
        sync()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        say(f"built and wrapped in {time.perf_counter() - t0:.1f} s", flush=True)

        aux_coef = router_aux_coef(config)
        result["router_aux_loss_coef"] = aux_coef
        gen = torch.Generator(device=device).manual_seed(args.seed + rank)
        step_seconds = []
        for step in range(1, args.steps + 1):
            if windows is not None:
                w = torch.from_numpy(windows[list(pick(step - 1, rank))]).to(device)
            else:
                w = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device=device, generator=gen)
            sync()
            dist.barrier()
            start = time.perf_counter()
            loss = step_loss(forward(w[:, :-1]), w[:, 1:], aux_coef)
            update(loss)
            sync()
            dist.barrier()
            seconds = time.perf_counter() - start
            step_seconds.append(seconds)
            say(f"step {step:4d}/{args.steps} | loss {loss.item():.4f} | {seconds:.3f} s | {tokens / seconds:,.0f} tok/s",
                flush=True)
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as e:
        # A failed pinned (host) allocation comes as a RuntimeError naming CUDA, not a MemoryError.
        if isinstance(e, torch.cuda.OutOfMemoryError):
            what = "out of GPU memory"
        elif isinstance(e, MemoryError):
            what = "out of host memory"
        elif "out of memory" in str(e):
            what = "out of memory (pinned host or GPU)"
        else:
            raise
        detail = str(e).splitlines()[0] if str(e) else ""
        say(f"{label}: {what} at seq {args.seq} x batch {args.batch}{': ' + detail if detail else ''}")
        result["error"] = what
        return finish(3)

    mean_s, low, high, mean_rate = summarize(step_seconds, tokens)
    result.update(step_seconds=step_seconds, mean_step_s=mean_s, tokens_per_s=mean_rate, tokens_per_s_range=[low, high])
    code = finish(0)
    say(f"{label}, seq {args.seq} x batch {args.batch} x {world} GPU(s), steps 2-{args.steps}: {mean_s:.3f} s a step, "
        f"{mean_rate:,.0f} tok/s ({low:,.0f}-{high:,.0f}); GPU reserved peak "
        f"{result['gpu_reserved_peak_bytes'] / 2**30:.1f} GiB (allocated {result['gpu_allocated_peak_bytes'] / 2**30:.1f}), "
        f"host RSS peak {result['host_rss_peak_bytes'] / 2**30:.1f} GiB")
    return code
