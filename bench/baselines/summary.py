"""The peers' table of a PARTS=peers run (scripts/gpu-check.sh): OOM's tokens/s against each peer's
at the same seq and batch, from the logs in one folder. Standard library only.

The folder holds, per setting: peer-oom-SEQ-BATCH.jsonl (oom-train's metrics), and per peer mode
peer-run-MODE-SEQ-BATCH.log, its .json when the run got that far, its .json.rss (the host RSS
high-water mark the run had reached: common.RssWatch) and its .rc as gpu-check.sh writes it (the
exit status, the seconds it ran, its time limit: why_no_result). Rows come from the logs, so a peer that left no JSON is named, not left out.
"""
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def oom_figures(path):
    """oom-train's tokens/s over the steps after the first (as the peers' are: common.summarize), its
    GPU peak and its host RSS high-water mark (bytes), from its metrics.jsonl. No rate where a step
    was skipped (a non-finite loss: no backward, no update, a shorter step than the peer's)."""
    every = [json.loads(line) for line in open(path) if line.strip()]
    if len(every) < 2 or any(s.get("skipped") for s in every):
        return None, 0, 0
    rate = common.summarize([s["step_s"] for s in every], every[0]["tokens"])[3]
    steps = every[1:]
    return (rate, max(s["device_peak_bytes"] for s in steps),
            max(s.get("host_rss_peak_bytes", s["host_rss_bytes"]) for s in steps))


def why_no_result(rc_path, log, rss_path=None):
    """Why a peer left no JSON, from its .rc file: the exit status, then (gpu-check.sh since the
    thirty-third session) the seconds it ran and its time limit, 0 where it was skipped. `timeout`
    sends its KILL 10 s after the limit, so a SIGKILL (137) before the limit (2 s allowed for the
    whole-second clock) came from elsewhere: on these machines, the host's out-of-memory killer
    (a peer past the host's memory dies so, without a Python error)."""
    reached = ""  # common.RssWatch's last word: how much host memory the run held when it ended
    if rss_path and os.path.exists(rss_path):
        text = open(rss_path).read().strip()
        if text.isdigit():
            reached = f", its host RSS at least {int(text) / 2**30:.1f} GiB"
    fields = open(rc_path).read().split() if os.path.exists(rc_path) else []
    rc = fields[0] if fields else "?"
    took, limit = (int(fields[1]), int(fields[2])) if len(fields) >= 3 else (None, None)
    if rc == "137" and took is not None and limit > 0 and took + 2 < limit:
        return (f"killed (SIGKILL) after {took} s, inside its {limit} s limit: not a time cut, "
                f"likely the host's out-of-memory killer{reached} ({log})")
    if rc in ("124", "137"):
        if limit == 0:
            return f"not run: the call's time budget was spent ({log})"
        return f"not finished: cut by its time limit ({log})" if took is not None else \
            f"not finished: skipped or cut by its time limit ({log})"
    return f"failed, exit {rc}, no result{reached} ({log})"


def peer_rows(folder):
    """One dict per (setting, peer mode): seq, batch, mode, label, ours, theirs (tokens/s or None),
    error (None or why there is no figure), the GPU and host peaks of both, and the data used."""
    rows = []
    names = sorted(os.listdir(folder))
    for name in names:
        m = re.match(r"peer-oom-(\d+)-(\d+)\.jsonl$", name)
        if not m:
            continue
        seq, batch = int(m.group(1)), int(m.group(2))
        ours, ours_gpu, ours_host = oom_figures(os.path.join(folder, name))
        for log in names:
            pm = re.match(rf"peer-run-([a-z0-9-]+)-{seq}-{batch}\.log$", log)
            if not pm:
                continue
            mode, stem = pm.group(1), os.path.join(folder, log[:-len(".log")])
            peer = json.load(open(stem + ".json")) if os.path.exists(stem + ".json") else {}
            error = peer.get("error")
            if not peer:
                error = why_no_result(stem + ".rc", log, stem + ".json.rss")
            rows.append({"seq": seq, "batch": batch, "mode": mode, "label": common.mode_label(mode),
                         "ours": ours, "theirs": peer.get("tokens_per_s"), "error": error,
                         "ours_gpu": ours_gpu, "theirs_gpu": peer.get("gpu_reserved_peak_bytes", 0),
                         "ours_host": ours_host, "theirs_host": peer.get("host_rss_peak_bytes", 0),
                         "data": "same windows" if peer.get("batches") else "random tokens"})
    return rows


def format_rows(rows):
    """The table's lines (GiB: GPU peak, host RSS high-water mark)."""
    lines = []
    for r in rows:
        head = f"seq {r['seq']} x batch {r['batch']}: OOM {r['ours']:,.0f}" if r["ours"] else \
            f"seq {r['seq']} x batch {r['batch']}: OOM no rate (too few steps, or one skipped)"
        if r["error"] or not r["theirs"]:
            lines.append(f"{head}; {r['label']}: {r['error'] or 'no result'}")
            continue
        ratio = f" = {r['ours'] / r['theirs']:.2f}x" if r["ours"] else ""
        lines.append(f"{head} vs {r['label']} {r['theirs']:,.0f}{ratio}; GPU {r['ours_gpu'] / 2**30:.1f} vs "
                     f"{r['theirs_gpu'] / 2**30:.1f}, host {r['ours_host'] / 2**30:.1f} vs "
                     f"{r['theirs_host'] / 2**30:.1f}; {r['data']}")
    return lines
