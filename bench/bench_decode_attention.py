"""Decode attention kernels at the rollout's shape (one query token per row, GQA packed).

    python bench/bench_decode_attention.py --json OUT.json          # GPU

Qwen3-1.7B's attention shape at the rollout bench's batch: 32 rows x 8 KV heads x 2 query
heads per KV head x head dim 128, a bf16 cache of 1,216 columns with random left padding
(`--padding`, default 0-99 columns a row), read up to a window limit (the decode loop's KV
windows), the last `--unwritten` columns before the limit masked (the window's unwritten
end). Per implementation and limit:
28 calls (one per layer, each layer its own K/V buffers, so the cache is not served from
L2) recorded in one CUDA graph and replayed; microseconds per call, the K/V read rate over
the window's columns and over the attended ones only, and the largest difference from a
float64 reference.

Implementations: those of `decode_attention` (sdpa = torch's pick; split_kv with its
defaults, `split_kv[nospan]` looping over every block of the window, and the launch
configurations of SPLIT_SWEEP and, for split_kv_new_token, NEW_TOKEN_SWEEP); `split_kv_new_token`,
which also makes the query and the new K/V column from a q/k/v product, against
`decode_qkv+split_kv`, the two kernels it replaces: their new column is the window's last
attended one, their error is against float64 attention with decode_qkv's query) and, for
comparison only, sdpa with one backend forced, the bmm-softmax-bmm form (eager and under torch.compile) and
torch's flex_attention (compiled).
"""
from __future__ import annotations

import argparse
import functools
import math
import re
import sys
import time

import common
import torch

from opsd.rollout.kernels import attention as decode_attention
from opsd.rollout.kernels import qkv as decode_qkv

LAYERS, BATCH, KV_HEADS, GROUPS, DIM, LENGTH = 28, 32, 8, 2, 128, 1216
# (block, warps, stages, chunks, span) of split_kv to measure (chunks None: split_count decides;
# span: loop over each row's attended span only, decode_attention.SPLIT_SPAN)
SPLIT_SWEEP = [(64, 4, 2, 1, False), (64, 4, 2, 2, False), (64, 4, 2, 4, False), (32, 4, 2, 1, False),
               (128, 4, 2, 1, False), (128, 8, 2, 1, False), (64, 4, 3, 1, False), (64, 4, 4, 1, False),
               (128, 8, 3, 1, False), (32, 2, 3, None, False), (128, 8, 3, None, False),
               (64, 4, 2, 1, True), (64, 4, 3, 1, True), (64, 4, 2, 2, True), (64, 4, 3, 2, True),
               (64, 4, 4, 2, True), (64, 4, 3, 3, True), (64, 4, 4, 4, True), (32, 4, 3, 2, True),
               (32, 4, 4, 4, True), (128, 8, 3, 2, True), (128, 4, 2, 2, True)]
# (block, warps, stages) of split_kv_new_token to measure (one chunk, span loop)
NEW_TOKEN_SWEEP = [(64, 4, 2), (64, 4, 4), (64, 2, 3), (64, 8, 3), (32, 4, 3), (32, 4, 4), (32, 4, 6), (32, 2, 4),
                   (128, 4, 2), (128, 8, 2)]


def reference(query, key, value, mask, scale):
    q, k, v = query.double(), key.double(), value.double()
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    return scores.softmax(-1) @ v


def bmm(query, key, value, mask, scale):
    """The bmm-softmax-bmm form: scores by a batched matmul (float32 accumulation and result),
    masked softmax in float32, probabilities in the value dtype times V."""
    batch, heads, groups, dim = query.shape
    q = query.reshape(batch * heads, groups, dim)
    k = key.reshape(batch * heads, key.shape[-2], dim).transpose(1, 2)
    scores = torch.bmm(q, k, out_dtype=torch.float32).view(batch, heads, groups, -1)
    probs = scores.mul_(scale).masked_fill_(~mask, -math.inf).softmax(-1).to(value.dtype)
    return torch.matmul(probs, value)


NEW_TOKEN_VARIANTS = ("split_kv_new_token", "decode_qkv+split_kv")


def new_token_inputs(device, gen) -> dict:
    """A decode step's q/k/v product for Qwen3-1.7B's attention (q/k norm weights, eps, cos, sin)."""
    heads = KV_HEADS * GROUPS
    qkv = (torch.randn(BATCH, (heads + 2 * KV_HEADS) * DIM, generator=gen) * 2).to(device, torch.bfloat16)
    weights = [(torch.rand(DIM, generator=gen) + 0.5).to(device, torch.bfloat16) for _ in range(2)]
    angles = torch.arange(1, BATCH + 1)[:, None] * torch.rand(1, DIM, generator=gen) * 7
    return {"qkv": qkv, "heads": heads, "q_weight": weights[0], "k_weight": weights[1], "eps": 1e-6,
            "cos": angles.cos().to(device, torch.bfloat16), "sin": angles.sin().to(device, torch.bfloat16)}


def candidates(limit_names: list[str], new: dict, slots: dict) -> dict:
    """name -> fn(query, key, value, mask, scale); the new-token variants ignore the query and
    make theirs from `new` (writing column slots[limit] of the key / value they are given)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forced(backend):
        def run(q, k, v, m, s):
            with sdpa_kernel([backend]):
                return decode_attention.sdpa(q, k, v, m, s)
        return run

    compiled_bmm = torch.compile(bmm, dynamic=False)

    def flex(q, k, v, m, s):
        from torch.nn.attention.flex_attention import flex_attention
        fn = _compiled_flex(flex_attention)
        valid = m.reshape(m.shape[0], m.shape[-1])

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(valid[b, kv_idx], score, -math.inf)

        batch, heads, groups, dim = q.shape
        out = fn(q.reshape(batch, heads * groups, 1, dim), k, v, score_mod=score_mod, scale=s, enable_gqa=True)
        return out.reshape(batch, heads, groups, dim)

    def new_token(q, k, v, m, s, **launch):
        token = decode_attention.NewToken(**new, slot=slots[k.shape[-2]])
        return decode_attention.split_kv_new_token(token, k, v, m, s, **launch)

    def two_kernels(q, k, v, m, s):
        return decode_attention.split_kv(_prepared_query(new, k, v, slots[k.shape[-2]]).view(q.shape), k, v, m, s)

    table = {
        "sdpa": decode_attention.sdpa,
        "sdpa[cudnn]": forced(SDPBackend.CUDNN_ATTENTION),
        "sdpa[efficient]": forced(SDPBackend.EFFICIENT_ATTENTION),
        "bmm": bmm,
        "split_kv": decode_attention.split_kv,
        "split_kv[nospan]": functools.partial(decode_attention.split_kv, span=False),
        "split_kv_new_token": new_token,
        "decode_qkv+split_kv": two_kernels,
    }
    for block, warps, stages, chunks, span in SPLIT_SWEEP:
        table[f"split_kv[{block},{warps},{stages},{chunks}{',span' if span else ''}]"] = functools.partial(
            decode_attention.split_kv, block=block, warps=warps, stages=stages, chunks=chunks, span=span)
    for block, warps, stages in NEW_TOKEN_SWEEP:
        table[f"split_kv_new_token[{block},{warps},{stages}]"] = functools.partial(
            new_token, block=block, warps=warps, stages=stages)
    table.update({"bmm[compiled]": compiled_bmm, "flex[compiled]": flex})  # last: they compile per limit
    return {name: fn for name, fn in table.items() if not limit_names or name in limit_names}


def _prepared_query(new: dict, key, value, slot):
    return decode_qkv.triton_prepare(new["qkv"], new["heads"], KV_HEADS, new["q_weight"], new["k_weight"],
                                     new["eps"], new["cos"], new["sin"], key, value, slot)


@functools.cache
def _compiled_flex(flex_attention):
    return torch.compile(flex_attention, dynamic=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--limits", default="320,768,1216")
    parser.add_argument("--only", default="", help="comma-separated implementation names (default: all); "
                        "the commas inside a name's brackets belong to the name")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--budget-s", type=float, default=200)
    parser.add_argument("--padding", default="0,100", help="left padding per row: LOW,HIGH (HIGH excluded)")
    parser.add_argument("--unwritten", type=int, default=0, help="masked columns before each limit")
    opts = parser.parse_args()
    start = time.time()
    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    keys = [torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=gen).to(device, torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=gen).to(device, torch.bfloat16)
              for _ in range(LAYERS)]
    query = (torch.randn(BATCH, KV_HEADS, GROUPS, DIM, generator=gen) * 3).to(device, torch.bfloat16)
    low, high = (int(x) for x in opts.padding.split(","))
    padding = torch.randint(low, high, (BATCH,), generator=gen)
    valid = (torch.arange(LENGTH)[None, :] >= padding[:, None]).to(device)
    scale = DIM ** -0.5
    shape = {"layers": LAYERS, "batch": BATCH, "kv_heads": KV_HEADS, "groups": GROUPS, "head_dim": DIM,
             "cache": LENGTH, "padding": [low, high], "unwritten": opts.unwritten}
    results = {"machine": common.machine(), "shape": shape, "rows": []}
    limits = [int(x) for x in opts.limits.split(",")]
    new = new_token_inputs(device, gen)
    slots = {limit: torch.tensor([limit - opts.unwritten - 1], device=device) for limit in limits}
    chosen = candidates([n for n in re.split(r",(?![^\[]*\])", opts.only) if n], new, slots)
    for name, fn in chosen.items():
        for limit in limits:
            if time.time() - start > opts.budget_s:
                results["rows"].append({"impl": name, "limit": limit, "status": "skipped (budget)"})
                continue
            mask = valid[:, None, None, :limit].clone()
            mask[..., max(0, limit - opts.unwritten):] = False
            row = {"impl": name, "limit": limit}
            try:
                def layers(fn=fn, limit=limit, mask=mask):
                    return [fn(query, k[:, :, :limit], v[:, :, :limit], mask, scale)
                            for k, v in zip(keys, values, strict=True)]

                out = fn(query, keys[0][:, :, :limit], values[0][:, :, :limit], mask, scale)
                ref_query = query
                # the query decode_qkv makes (it writes the same column again)
                if name.split("[")[0] in NEW_TOKEN_VARIANTS:
                    ref_query = _prepared_query(new, keys[0][:, :, :limit], values[0][:, :, :limit],
                                                slots[limit]).view(query.shape)
                ref = reference(ref_query, keys[0][:, :, :limit], values[0][:, :, :limit], mask, scale)
                row["max_abs_err"] = (out.double() - ref).abs().max().item()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    layers()
                    layers()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    layers()
                graph.replay()
                torch.cuda.synchronize()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(opts.replays):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                us = begin.elapsed_time(end) * 1000 / opts.replays / LAYERS
                read = 2 * BATCH * KV_HEADS * limit * DIM * 2
                attended = 2 * KV_HEADS * int(mask.sum()) * DIM * 2
                row.update(status="ok", us_per_call=us, kv_read_tb_s=read / us / 1e6,
                           attended_tb_s=attended / us / 1e6)
                del graph
            except Exception as exc:  # noqa: BLE001 - report any kernel's failure and go on
                row.update(status=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            results["rows"].append(row)
            print(f"[attention] {name} limit={limit}: " + (
                f"{row['us_per_call']:.1f} us/call, {row['kv_read_tb_s']:.2f} TB/s over the window, "
                f"{row['attended_tb_s']:.2f} attended, max err {row['max_abs_err']:.2e}"
                if row.get("status") == "ok" else row["status"]), flush=True)
            common.write_json(opts.json, results)
    results["elapsed_s"] = time.time() - start
    return common.finish(results, opts.json, summarize(results, limits))


def summarize(results, limits) -> str:
    by_impl: dict[str, dict] = {}
    for row in results["rows"]:
        by_impl.setdefault(row["impl"], {})[row["limit"]] = row
    table = []
    for name, rows in by_impl.items():
        cells = []
        for limit in limits:
            row = rows.get(limit, {})
            cells.append(f"{row['us_per_call']:.1f} ({row['kv_read_tb_s']:.2f} / {row['attended_tb_s']:.2f})"
                         if row.get("status") == "ok"
                         else (row.get("status", "-")[:30]))
        errors = [r["max_abs_err"] for r in rows.values() if "max_abs_err" in r]
        table.append([name, *cells, f"{max(errors):.1e}" if errors else "-"])
    header = ["implementation", *[f"L={limit}: us (TB/s window / attended)" for limit in limits],
              "max |err| vs float64"]
    split = {name: sum(r["us_per_call"] for r in rows.values()) for name, rows in by_impl.items()
             if name.startswith("split_kv") and all(rows.get(x, {}).get("status") == "ok" for x in limits)}
    best = min(split, key=split.get) if split else "-"
    return (f"## Decode attention per call (x{LAYERS} layers in one graph), left padding "
            f"{results['shape']['padding']}, unwritten {results['shape']['unwritten']}, {results['machine']}\n\n"
            + common.markdown_table(header, table) + f"\n\nfastest split_kv (sum over the limits): {best}")


if __name__ == "__main__":
    sys.exit(main())
