"""The text view of ``qlora-supervise plan``: the plan's JSON object (plan.py) for a person."""

from __future__ import annotations

from typing import Any

from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.jobfile import hub
from qlora_supervise.supervisor.loop.planner import UNMODELLED_RUN


def render(plan: dict[str, Any]) -> list[str]:
    """The plan for a person: components, card, verdict, start config, rungs, host RAM."""
    lines = [f"plan for {plan['job']}", f"model: {hub.describe(plan['model'])}"]
    if u := plan["unsupported"]:
        lines += [f"NOT MODELLED ({u['reason']}): {u['detail']}; no GPU prediction", f"run: {UNMODELLED_RUN}"]
    else:
        lines += _render_prediction(plan)
    lines += [f"note: {n}" for n in plan["notes"]]
    lines += _render_host(plan["host"])
    return lines


def _render_prediction(plan: dict[str, Any]) -> list[str]:
    s, w = plan["shape"], plan["as_written"]
    # Under torchrun every number is one rank's card (FSDP: its shard of the weights).
    ranks = w["knobs"].get("world_size", 1)
    mode = "FSDP: weights sharded" if w["knobs"].get("fsdp") else "DDP: a replica each"
    per_rank = f" (per rank, {ranks} ranks, {mode})" if ranks > 1 else ""
    lines = [
        f"shape: hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads / {s['kv_heads']} kv, "
        f"MLP {s['intermediate']}, vocab {s['vocab']} ({'tied' if s['tie_word_embeddings'] else 'untied'}), "
        f"{s['params'] / 1e9:.2f} B params; LoRA on {', '.join(plan['targets'])}",
        f"predicted peak as written: {format_bytes(w['peak_bytes'])} allocated ({w['phase']}), "
        f"{format_bytes(w['reserved_bytes'])} reserved, {format_bytes(w['card_bytes'])} on the card"
        f"{per_rank}",
    ]
    for prefix, terms in (("", w["components"]), ("(outside allocator) ", w["outside"])):
        lines += [f"  {prefix}{name:<20} {format_bytes(size):>12}" for name, size in terms.items()]
    card = plan["card"]
    if card["budget_bytes"] is None:
        lines.append("card: unknown (no --gpu-memory, no gpu_memory_limit, no NVML): no fit verdict")
    else:
        total = "" if card["total_bytes"] is None else f"{format_bytes(card['total_bytes'])}, "
        lines.append(
            f"card: {total}from {card['source']}; budget {format_bytes(card['budget_bytes'])} "
            f"(reserve {format_bytes(card['reserve_bytes'])}: {card['reserve_why']})"
        )
        verdict = "yes" if plan["fits_as_written"] else "NO"
        lines.append(f"fits as written (with the {plan['start']['margin']:.0%} margin): {verdict}")
        lines += [*_render_start(plan["start"]), *_render_ranking(plan["ranking"])]
    lines.append("rungs (each alone on the job as written; tokens/s by the throughput model):")
    for r in plan["rungs"]:
        peak = "no change" if r["peak_bytes"] is None else format_bytes(r["peak_bytes"])
        speed = "" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:>8.0f} tok/s ({-r['cost']:+.0%})"
        lines.append(f"  {r['name']:<24} {peak:>12}  {r['cost_class']:<10} {speed}")
    return lines


#: The ranking's lines in the text view (the JSON has every candidate).
RANKING_SHOWN = 12


def _render_ranking(ranking: list[dict[str, Any]]) -> list[str]:
    if not ranking:
        return []
    lines = [f"ranking: {len(ranking)} fitting candidate(s), fastest first (effective batch kept):"]
    for c in ranking[:RANKING_SHOWN]:
        changes = ", ".join(f"{k} {new}" for k, (_, new) in c["changes"].items()) or "as written"
        source = "measured" if c["measured"] else "predicted"
        peak = format_bytes(c["peak_bytes"])
        host = "" if c.get("host_peak_bytes") is None else f" host {format_bytes(c['host_peak_bytes']):>9}"
        speed = f"{c['tokens_per_s']:>8.0f} tok/s {source:<9}"
        lines.append(f"  {c['rank']:>2}. {speed} {peak:>10}{host}  {c['cost_class']:<10} {changes}")
    if len(ranking) > RANKING_SHOWN:
        lines.append(f"  ... and {len(ranking) - RANKING_SHOWN} more (--json lists them all)")
    return lines


def _render_start(start: dict[str, Any]) -> list[str]:
    why = [f"  why: {reason}" for reason in start["reasons"]]
    if start["nothing_fits"] is not None:  # a host's message names host memory
        return [f"NOTHING FITS: {start['nothing_fits']['message']}", *why]
    speed = "" if start["tokens_per_s"] is None else f", {start['tokens_per_s']:.0f} tokens/s"
    if not start["changes"]:
        return [f"start from: the job as written{speed}"]
    changes = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in start["changes"].items())
    head = "start from (QUALITY KNOBS CHANGED)" if start["quality_changed"] else "start from"
    return [f"{head}: {changes}; predicted {format_bytes(start['peak_bytes'])}{speed}", *why]


def _render_host(host: dict[str, Any]) -> list[str]:
    if host["load_peak_bytes"] is None:
        return ["host RAM: checkpoint size unknown"]
    limit = "none" if (cap := host["cgroup_limit_bytes"]) is None else format_bytes(cap)
    lines = [
        f"host RAM to load: {format_bytes(host['load_peak_bytes'])}, to merge: "
        f"{format_bytes(host['merge_peak_bytes'])} (16-bit checkpoint "
        f"{format_bytes(host['checkpoint_bytes'])}); available now {format_bytes(host['available_bytes'])}, "
        f"cgroup limit {limit}",
        f"  basis: {host['basis']}",
    ]
    if host["load_fits"] is False:
        room = f"{host['room_of']} ({format_bytes(host['room_bytes'])})"
        lines.append(f"  WARNING: loading is predicted to need more host RAM than the {room}")
    if host.get("budget_bytes") is None:
        return lines
    sources = {"job": "resources.host_memory_limit", "flag": "--host-memory less a reserve"}
    source = sources.get(host["budget_source"], "available now (capped by the cgroup) less a reserve")
    lines.append(f"host budget: {format_bytes(host['budget_bytes'])} ({source})")
    if host["train_peak_bytes"] is not None:
        terms = ", ".join(f"{k} {format_bytes(v)}" for k, v in host["train_components"].items())
        lines += [
            f"host need of the start: {format_bytes(host['train_peak_bytes'])} (at {host['train_phase']}); "
            f"training itself {format_bytes(host['train_phase_bytes'])} ({terms})",
            f"  basis: {host['train_basis']}",
        ]
    if host["rejected"]:
        lines.append(
            f"  {host['rejected']} config(s) that fit the card are no candidates: host need "
            f"{format_bytes(host['rejected_smallest_bytes'])} or more is over the host budget"
        )
    return lines
