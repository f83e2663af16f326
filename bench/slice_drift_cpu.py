"""Sampler (transformers glm5_next, fp32) against trainer (our GLMModel, fp32 / bf16) log-prob
drift at the full-width glm53_flash_slice shapes on CPU, reduced in vocabulary only (or with a
router made decisive, so that no expert choice can flip). It answers whether the one-H200 RL
run's bf16 drift at the slice's width (bench/results/h200_rl_main_base/) is a trainer/sampler
mismatch or bf16 rounding: bench/results/cpu_slice_drift/ holds its answer.

    PY=".venv/bin/python bench/slice_drift_cpu.py"   # TORCHDYNAMO_DISABLE=1, from the repo root
    $PY make WORK --vocab 4096 && $PY rows WORK --lens 2200,2180
    $PY hf WORK WORK/hf_fp32.pt
    $PY ours WORK WORK/ours_fp32.pt --dtype float32
    $PY ours WORK WORK/ours_bf16.pt --dtype bfloat16
    $PY compare WORK WORK/hf_fp32.pt WORK/ours_fp32.pt --label 1 --json WORK/cmp1.json  # and 2, 3
    $PY decisive WORK WORK_D && $PY rows WORK_D --lens 2200,1800   # then ours fp32/bf16, compare

About 45 minutes on 2 cores, 16 GB peak. WORK holds recipe.yaml (the slice recipe with the CPU
overrides), hf/ (the random checkpoint made by examples/finetune_1m/run_cpu.py's
make_hf_checkpoint, bf16) and rows.pt. Each model runs in a process of its own (memory); each
saves per row the full fp32 log-softmax [T, V], and for row 0 the per-layer outputs, the token
mixer's output, the MoE routing (experts per token) and the DSA selection (key positions per
query).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BASE_YAML = REPO / "recipes" / "glm53_flash_slice.yaml"


def t0():
    return time.time()


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# --------------------------------------------------------------------------------------- make

def write_recipe(work: Path, vocab: int, experts: int, topk: int, layers: int | None,
                 dsa_every: int | None, dsa_offset: int | None, dense: int | None) -> Path:
    raw = yaml.safe_load(BASE_YAML.read_text())
    m = raw["model"]
    m["vocab_size"] = vocab
    m["moe"]["num_experts"] = experts
    m["moe"]["top_k"] = topk
    if layers is not None:
        m["num_layers"] = layers
    if dsa_every is not None:
        m["dsa_every"] = dsa_every
    if dsa_offset is not None:
        m["dsa_offset"] = dsa_offset
    if dense is not None:
        m["num_dense_layers"] = dense
    m["params_dtype"] = "bfloat16"  # the checkpoint is saved in this dtype (as the run's)
    m["dsa"]["kernel"] = "torch"
    raw["kda"]["kernel"] = "torch"
    raw["run"] = {"device": "cpu", "num_workers": 1, "output_dir": str(work / "run")}
    raw["data"]["seq_len"] = 2200
    raw["description"] = "glm53_flash_slice at full width on CPU, small vocabulary (drift study)"
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def cmd_make(args):
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = write_recipe(work, args.vocab, args.experts, args.topk, args.layers, args.dsa_every,
                        args.dsa_offset, args.dense)
    from skyrl_megatron_kda.recipes import load_recipe
    r = load_recipe(str(path)).recipe
    log("recipe", r.model.layer_types(), r.model.mlp_types(), r.model.vocab_size,
        r.model.moe.num_experts, r.model.moe.top_k)
    if not (work / "hf" / "config.json").exists():
        from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import _glm5_next_class
        _glm5_next_class()  # the sampler's torch-path import first
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "finetune_run_cpu", REPO / "examples" / "finetune_1m" / "run_cpu.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        s = t0()
        mod.make_hf_checkpoint(work / "hf", recipe=str(path))
        log(f"checkpoint written in {time.time() - s:.0f}s")


def cmd_decisive(args):
    """A copy of WORK/hf as WORK2/hf whose router score-correction biases make the same top_k
    experts win for every token by a margin of 10 (no routing choice can flip)."""
    import shutil
    from safetensors.torch import load_file, save_file
    src, dst = Path(args.work), Path(args.out)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "recipe.yaml", dst / "recipe.yaml")
    if (src / "rows.pt").exists():
        shutil.copy(src / "rows.pt", dst / "rows.pt")
    (dst / "hf").mkdir(exist_ok=True)
    for f in (src / "hf").iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / "hf" / f.name)
            continue
        t = load_file(f)
        changed = 0
        for name in list(t):
            if name.endswith("e_score_correction_bias"):
                E = t[name].numel()
                k = yaml.safe_load((src / "recipe.yaml").read_text())["model"]["moe"]["top_k"]
                bias = torch.zeros(E, dtype=torch.float32)
                bias[:k] = 10.0  # experts 0..k-1 always chosen
                t[name] = bias.to(t[name].dtype)
                changed += 1
        save_file(t, dst / "hf" / f.name, metadata={"format": "pt"})
        log(f.name, "biases changed:", changed)


# --------------------------------------------------------------------------------------- rows

def cmd_rows(args):
    """Rows like the GPU run's rollouts: a prompt of word tokens (ids 3..28, the rl_tiny words)
    then 16 'response' tokens drawn uniformly from the vocabulary."""
    work = Path(args.work)
    vocab = yaml.safe_load((work / "recipe.yaml").read_text())["model"]["vocab_size"]
    g = torch.Generator().manual_seed(11)
    rows = []
    for n in [int(x) for x in args.lens.split(",")]:
        prompt = torch.randint(3, 29, (n - 16,), generator=g)
        resp = torch.randint(3, vocab, (16,), generator=g)
        rows.append(torch.cat([prompt, resp]))
    torch.save(rows, work / "rows.pt")
    log("rows", [len(r) for r in rows])


# --------------------------------------------------------------------------------------- run

def _layers_hooks(layers, seq_first: bool, rec: dict, attn_name: str, mlp_name: str):
    """Hooks recording each layer's output and its token mixer's and MLP's (fp32 [s, ...]; ours
    are sequence-first [s, b, ...], transformers' batch-first [b, s, ...])."""
    def recorder(key: str, i: int):
        def hook(mod, inp, out):
            x = (out[0] if isinstance(out, tuple) else out).detach().float()
            rec.setdefault(key, {})[i] = (x[:, 0] if seq_first else x[0]).clone()
        return hook

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(recorder("layer_out", i)))
        hooks.append(getattr(layer, attn_name).register_forward_hook(recorder("attn_out", i)))
        hooks.append(getattr(layer, mlp_name).register_forward_hook(recorder("mlp_out", i)))
    return hooks


def _selection_hooks(model, rec: dict, router_cls: str, indexer_cls: str, ours: bool):
    """Hooks recording each MoE router's choice (a [T, E] bool map) and each DSA indexer's
    selection (sorted key positions per query), with the counts of routers and indexers."""
    hs = []
    routers = [m for m in model.modules() if type(m).__name__ == router_cls]
    indexers = [m for m in model.modules() if type(m).__name__ == indexer_cls]

    for j, r in enumerate(routers):
        def hook(mod, inp, out, j=j):
            if ours:
                probs, routing_map = out  # [T, E] each
                chosen = routing_map.nonzero()  # (token, expert)
                sel = torch.zeros_like(routing_map, dtype=torch.bool)
                sel[chosen[:, 0], chosen[:, 1]] = True
                rec.setdefault("route", {})[j] = sel.cpu()
            else:
                _, w, idx = out  # [T, k]
                E = mod.num_experts
                sel = torch.zeros(idx.shape[0], E, dtype=torch.bool)
                sel.scatter_(1, idx.long(), True)
                rec.setdefault("route", {})[j] = sel
        hs.append(r.register_forward_hook(hook))
    for j, ix in enumerate(indexers):
        def hook(mod, inp, out, j=j):
            t = out[0]  # [s, K] natural key positions, -1 none
            rec.setdefault("dsa_sel", {})[j] = t.detach().to(torch.int32).sort(-1).values.cpu()
        # transformers' indexer forward is wrapped per instance (match_trainer_dsa_ties); a
        # forward hook still sees its output
        hs.append(ix.register_forward_hook(hook))
    return hs, len(routers), len(indexers)


def _score_rows(rows, score, model, layers, seq_first: bool, names: tuple[str, str, str, str]) -> dict:
    """Each row through ``score(ids) -> {key: value}`` (values listed per row), without gradient;
    row 0 with hooks recording ``layers``' outputs (``names``: the token mixer's and the MLP's
    attribute, the router's and the indexer's class) and ``model``'s routes and selections."""
    attn, mlp, router, indexer = names
    out, rec = {"times": []}, {}
    for n, ids in enumerate(rows):
        hooks = []
        if n == 0:
            hooks = _layers_hooks(layers, seq_first, rec, attn, mlp)
            more, nr, ni = _selection_hooks(model, rec, router, indexer, ours=seq_first)
            hooks += more
            log("hooked routers", nr, "indexers", ni)
        s = t0()
        with torch.no_grad():
            for key, value in score(ids).items():
                out.setdefault(key, []).append(value)
        out["times"].append(time.time() - s)
        log(f"row {n} ({len(ids)} tokens) {time.time() - s:.0f}s")
        for hk in hooks:
            hk.remove()
    out.update(rec)
    return out


def _summaries(logp_rows):
    return [lp.exp().mul(-lp).nan_to_num().sum(-1) for lp in logp_rows]


def _kda_by_head_groups(group: int):
    """transformers' torch KDA (chunk_kimi_delta_attention) holds [B, H, chunks, 64, 64, K] fp32
    tensors (three of 4.7 GB at 64 heads x 2,200 tokens): run it on groups of heads (heads are
    independent; the same function on each group, outputs concatenated). Memory only."""
    mod = sys.modules["transformers.models.glm5_next.modeling_glm5_next"]
    orig = mod.chunk_kimi_delta_attention

    def by_groups(query, key, value, g, beta, initial_state=None, output_final_state=False, **kw):
        assert initial_state is None and not output_final_state
        H = query.shape[2]
        outs = [orig(query[:, :, h:h + group], key[:, :, h:h + group], value[:, :, h:h + group],
                     g=g[:, :, h:h + group], beta=beta[:, :, h:h + group], initial_state=None,
                     output_final_state=False, **kw)[0] for h in range(0, H, group)]
        return torch.cat(outs, dim=2), None

    mod.chunk_kimi_delta_attention = by_groups


def cmd_hf(args):
    work = Path(args.work)
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import load_glm5_next
    s = t0()
    model = load_glm5_next(work / "hf", "cpu")
    _kda_by_head_groups(args.head_group)
    log(f"glm5_next loaded fp32 in {time.time() - s:.0f}s;",
        {p.dtype for p in model.parameters()})
    rows = torch.load(work / "rows.pt")

    def score(ids):
        logits = model(input_ids=ids[None], use_cache=False).logits.float()[0]
        return {"logp": torch.log_softmax(logits, -1)}

    out = _score_rows(rows, score, model, model.model.language_model.layers, False,
                      ("self_attn", "mlp", "Glm5NextTextTopkRouter", "Glm5NextTextIndexer"))
    torch.save(out, args.out)


def cmd_ours(args):
    work = Path(args.work)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from skyrl_megatron_kda.distributed.cpu import redirect_cuda_device_queries
    from skyrl_megatron_kda.model.glm import build_model
    from skyrl_megatron_kda.model.hf_io import load_hf_checkpoint
    from skyrl_megatron_kda.recipes import load_recipe

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    redirect_cuda_device_queries()
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    loaded = load_recipe(str(work / "recipe.yaml"), [f"model.params_dtype={args.dtype}"])
    recipe = loaded.recipe
    log("recipe: kda.kernel", recipe.kda.kernel, "dsa.kernel", recipe.model.dsa.kernel,
        "dtype", recipe.model.params_dtype, "layers", recipe.model.layer_types(), recipe.model.mlp_types())
    s = t0()
    torch.manual_seed(0)
    model = build_model(recipe, use_cpu=True)
    log(f"built in {time.time() - s:.0f}s"); s = t0()
    load_hf_checkpoint(model, work / "hf")
    model.eval()
    log(f"loaded in {time.time() - s:.0f}s;", {p.dtype for p in model.parameters()},
        sum(p.numel() for p in model.parameters()) / 1e9, "B params")
    rows = torch.load(work / "rows.pt")
    from skyrl_megatron_kda.model import head

    def score(ids):
        hidden = model._final_hidden(ids[None], None)
        logits, _ = model.output_layer(hidden, weight=model._output_weight())  # [s, 1, V]
        labels = ids[None].roll(-1, 1).transpose(0, 1).contiguous()
        tlp, _ = head.logprobs_from_logits(logits.clone(), labels, tp_group=model.pg_collection.tp)
        # trainer_logp: what token_logprobs gives (the head's path)
        return {"logp": torch.log_softmax(logits[:, 0].float(), -1), "trainer_logp": tlp[:, 0].float()}

    out = _score_rows(rows, score, model, model.layers, True,
                      ("self_attention", "mlp", "TopKRouter", "GlmKPoolIndexer"))
    torch.save(out, args.out)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------- compare

def _stats(x):
    return {"mean": float(x.mean()), "max": float(x.max()), "p99": float(x.quantile(0.99))}


def compare(work: Path, a: dict, b: dict, label: str) -> dict:
    rows = torch.load(work / "rows.pt")
    res = {"label": label}
    lab_d, exp_d, samp_d, tail_d, ent, kl = [], [], [], [], [], []
    g = torch.Generator().manual_seed(5)
    for ids, la, lb in zip(rows, a["logp"], b["logp"]):
        nxt = ids[1:]
        la, lb = la[:-1], lb[:-1]
        d = (la.gather(1, nxt[:, None]) - lb.gather(1, nxt[:, None]))[:, 0].abs()
        lab_d.append(d)
        tail_d.append(d[-16:])
        pa = la.exp()
        exp_d.append((pa * (la - lb).abs()).sum(-1))  # E_{y ~ a}|Δ log p(y)|: a sampled token
        y = torch.multinomial(pa, 1, generator=g)
        samp_d.append((la.gather(1, y) - lb.gather(1, y))[:, 0].abs())
        ent.append(-(pa * la).sum(-1))
        kl.append((pa * (la - lb)).sum(-1))
    cat = torch.cat
    res["per_row"] = [{"tokens": len(r), "label_mean": float(x.mean()), "label_max": float(x.max()),
                       "sampled_mean": float(y.mean()), "sampled_max": float(y.max()),
                       "entropy": float(e.mean())}
                      for r, x, y, e in zip(rows, lab_d, samp_d, ent)]
    res["label_tokens"] = _stats(cat(lab_d))
    res["response16_tokens"] = _stats(cat(tail_d))
    res["sampled_tokens"] = _stats(cat(samp_d))
    res["expected_sampled"] = float(cat(exp_d).mean())
    res["entropy_a"] = float(cat(ent).mean())
    res["kl_a_b"] = float(cat(kl).mean())
    pos = torch.cat([torch.arange(len(r) - 1) for r in rows])
    for lo, hi in ((0, 2048), (2048, 10 ** 9)):
        m = (pos >= lo) & (pos < hi)
        res[f"sampled_pos_{lo}_{hi}"] = float(cat(samp_d)[m].mean())
    # layers (row 0)
    if "layer_out" in a and "layer_out" in b:
        lay = {}
        for i in sorted(a["layer_out"]):
            entry = {}
            for key in ("attn_out", "mlp_out", "layer_out"):
                x, y = a[key][i], b[key][i]
                if x.shape != y.shape:
                    entry[key] = f"shapes {tuple(x.shape)} vs {tuple(y.shape)}"
                    continue
                entry[key] = float((x - y).norm() / y.norm())
                entry[key + "_maxabs"] = float((x - y).abs().max())
            lay[i] = entry
        res["layers_rel_err_row0"] = lay
    if "route" in a and "route" in b:
        rt = {}
        for j in sorted(a["route"]):
            x, y = a["route"][j], b["route"][j]
            diff = (x != y).any(-1)
            rt[j] = {"tokens_with_other_experts": float(diff.float().mean()),
                     "expert_slots_changed": float((x != y).sum() / 2 / x.sum())}
        res["routing_row0"] = rt
    if "dsa_sel" in a and "dsa_sel" in b:
        ds = {}
        for j in sorted(a["dsa_sel"]):
            x, y = a["dsa_sel"][j], b["dsa_sel"][j]
            if x.shape != y.shape:
                ds[j] = f"shapes {tuple(x.shape)} vs {tuple(y.shape)}"
                continue
            qdiff = (x != y).any(-1)
            # keys differing per query (set difference), for the queries past index_topk
            nd = []
            for q in torch.nonzero(qdiff)[:, 0].tolist():
                sx, sy = set(x[q].tolist()) - {-1}, set(y[q].tolist()) - {-1}
                nd.append(len(sx ^ sy) / 2)
            ds[j] = {"queries_with_other_keys": float(qdiff.float().mean()),
                     "queries_past_2048_with_other_keys": float(qdiff[2048:].float().mean()),
                     "mean_keys_swapped_when_differing": (sum(nd) / len(nd)) if nd else 0.0,
                     "selected_per_query": int((x[-1] >= 0).sum())}
        res["dsa_selection_row0"] = ds
    return res


def cmd_compare(args):
    work = Path(args.work)
    a, b = torch.load(args.a, weights_only=False), torch.load(args.b, weights_only=False)
    res = compare(work, a, b, args.label or f"{Path(args.a).stem} vs {Path(args.b).stem}")
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make"); m.add_argument("work")
    m.add_argument("--vocab", type=int, default=4096)
    m.add_argument("--experts", type=int, default=16); m.add_argument("--topk", type=int, default=8)
    m.add_argument("--layers", type=int); m.add_argument("--dsa-every", type=int)
    m.add_argument("--dsa-offset", type=int); m.add_argument("--dense", type=int)
    d = sub.add_parser("decisive"); d.add_argument("work"); d.add_argument("out")
    r = sub.add_parser("rows"); r.add_argument("work"); r.add_argument("--lens", default="2200,2180")
    h = sub.add_parser("hf"); h.add_argument("work"); h.add_argument("out")
    h.add_argument("--head-group", type=int, default=8)
    o = sub.add_parser("ours"); o.add_argument("work"); o.add_argument("out")
    o.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    c = sub.add_parser("compare"); c.add_argument("work"); c.add_argument("a"); c.add_argument("b")
    c.add_argument("--label"); c.add_argument("--json")
    args = p.parse_args()
    {"make": cmd_make, "decisive": cmd_decisive, "rows": cmd_rows, "hf": cmd_hf,
     "ours": cmd_ours, "compare": cmd_compare}[args.cmd](args)


if __name__ == "__main__":
    main()
