#!/usr/bin/env python3
"""Unit-cost replay of the head-dim-128 attention backward's grid on an H200's SMs, for the design
in docs/hopper.md ("Next: five products in the head-dim-128 backward, still deterministic").

One block an SM (the wgmma kernels' shared memory allows no more); blocks start in linear index
order as SMs free up. Work is counted in tile-pair products (128 keys x 64 queries x 128 d each):
  today:  dK/dV blocks, 4 products a step (S^T, dP^T, dV, dK), then the dQ blocks of the same grid
          (128 query rows over 64-key tiles: 3 products of a unit's size a tile);
  fused:  dK/dV blocks only, 5 products a step (+ dS K), and after each step a hand-off of the
          step's fp32 dQ tile that must follow the hand-off of the key block before it in the
          tile's order. `sync`: the hand-off sits on the block's critical path (the fifth
          session's mma.sync variant); `async`: the block goes on while it runs, except that a
          step's partial waits for the previous hand-off to free the single staging tile.
Orders: `last-first` (launch and add last key block first; ascending query tiles, heads outer:
the fifth session's), `first-first-desc` (launch and add key block 0 first; descending query
tiles, tiles outer and heads inner: the design's proposal), and `first-first-asc` (key block 0
first, ascending tiles, heads outer) to show why the descending walk matters.

Prints, per sequence length: the makespan in product units, against today's, and the share of the
SM time spent computing (the rest waits or idles). No GPU needed; the hand-off cost is a
parameter (a 32 KiB fp32 read-modify-write through L2 against ~1.9 us of products a step: 0.1-0.3
of a step's five products).
    python3 scripts/diag/fused_dq_replay.py [--sms 132] [--handoff 0.2] [--seqs 4096 16384 65536]
"""
import argparse
import heapq


def key_blocks(seq, keys=128):
    return (seq + keys - 1) // keys


def dkdv_tiles(nb, seq, keys=128, br=64):
    """Query tiles (64 rows) a key block visits: those with a row >= its first key."""
    first = (nb * keys) // br
    return list(range(first, (seq + br - 1) // br))


def last_key_block(i, seq, keys=128, br=64):
    return min((i * br + br - 1) // keys, key_blocks(seq) - 1)


def replay_today(seq, heads_q, heads_kv, sms):
    """Makespan of today's grid: dK/dV blocks (key block 0 first) then dQ blocks (longest first)."""
    group = heads_q // heads_kv
    jobs = []
    for hk in range(heads_kv):
        for nb in range(key_blocks(seq)):
            jobs.append(4.0 * group * len(dkdv_tiles(nb, seq)))
    q_blocks = (seq + 127) // 128
    for h in range(heads_q):
        for qb in reversed(range(q_blocks)):
            last_row = min(qb * 128 + 127, seq - 1)
            jobs.append(3.0 * (last_row // 64 + 1))
    free = [0.0] * sms
    heapq.heapify(free)
    end = 0.0
    for cost in jobs:
        t = heapq.heappop(free)
        heapq.heappush(free, t + cost)
        end = max(end, t + cost)
    return end, sum(jobs)


def step_order(nb, seq, group, order):
    tiles = dkdv_tiles(nb, seq)
    if order == "first-first-desc":
        return [(h, i) for i in reversed(tiles) for h in range(group)]
    return [(h, i) for h in range(group) for i in tiles]


def replay_fused(seq, heads_q, heads_kv, sms, handoff, order, mode):
    """Makespan of the fused grid. Hand-offs of a (query head, tile) go in key-block order:
    descending for last-first, ascending for the first-first orders. In both, a hand-off's
    predecessor belongs to a block launched earlier, so the blocks can be replayed one by one in
    launch order, each starting when the earliest of the SMs frees up."""
    group = heads_q // heads_kv
    nkb = key_blocks(seq)
    launch = []  # (kv head, key block) in linear index order
    for hk in range(heads_kv):
        blocks = list(range(nkb))
        if order == "last-first":
            blocks.reverse()
        launch += [(hk, nb) for nb in blocks]

    def predecessor(nb, i):
        if order == "last-first":
            return nb + 1 if nb + 1 <= last_key_block(i, seq) else None
        return nb - 1 if nb > 0 else None

    done = {}  # (kv head, key block, head, tile) -> hand-off end
    free = [0.0] * sms
    heapq.heapify(free)
    end_time = compute = 0.0
    for hk, nb in launch:
        start = heapq.heappop(free)
        consumer = handoff_end = start
        for h, i in step_order(nb, seq, group, order):
            prod_start = consumer if mode == "async" else max(consumer, handoff_end)
            prod_end = prod_start + 5.0
            compute += 5.0
            store = max(prod_end, handoff_end)  # the single staging tile is free again
            pred = predecessor(nb, i)
            h_start = max(store, done[(hk, pred, h, i)] if pred is not None else 0.0)
            handoff_end = h_start + handoff
            done[(hk, nb, h, i)] = handoff_end
            consumer = store if mode == "async" else handoff_end
        finish = max(consumer, handoff_end)
        end_time = max(end_time, finish)
        heapq.heappush(free, finish)
    return end_time, compute


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--handoff", type=float, default=0.2, help="hand-off cost in units of one tile-pair product")
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 4], metavar=("HQ", "HKV"))
    a = ap.parse_args()
    hq, hkv = a.heads
    print(f"B=1 Hq/Hkv={hq}/{hkv}, {a.sms} SMs, hand-off = {a.handoff} product(s); makespan in products, "
          f"speed against today's, busy = compute / (SMs x makespan)")
    for seq in a.seqs:
        today, work = replay_today(seq, hq, hkv, a.sms)
        print(f"S={seq:6d} today: {today:9.0f} (busy {work / (a.sms * today):.2f})")
        for order in ("last-first", "first-first-desc", "first-first-asc"):
            for mode in ("sync", "async"):
                span, comp = replay_fused(seq, hq, hkv, a.sms, a.handoff, order, mode)
                print(f"          {order:17s} {mode:5s}: {span:9.0f} = {today / span:4.2f}x today "
                      f"(busy {comp / (a.sms * span):.2f})")


if __name__ == "__main__":
    main()
