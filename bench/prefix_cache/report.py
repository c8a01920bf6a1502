"""What a run shows: the printed table, the plot and the summary's headline figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure
from bench.prefix_cache.analysis import GOAL_FROM_TURN, GOAL_RATIO


def figures(summary: dict[str, dict]) -> list[Figure]:
    """Per mode: each turn's TTFT on / off, the worst from turn 3, the last turn's median TTFT on and
    off; for epd the prefill's forward pass on / off per turn."""
    out = []
    for mode, s in summary.items():
        out += [Figure(f"{mode}: turn {turn} TTFT on / off", ratio, "x") for turn, ratio in s["ratio_on_off"].items()]
        out.append(Figure(f"{mode}: worst TTFT on / off, turns {GOAL_FROM_TURN}+ (goal <= {GOAL_RATIO})",
                          s["worst_ratio_from_turn_3"], "x"))
        last = max(s["ratio_on_off"], default=None)
        if last is not None:
            out += [Figure(f"{mode}: turn {last} TTFT p50, prefix caching {side}", s[side][last]["ttft_ms_median"], "ms")
                    for side in ("on", "off")]
        out += [Figure(f"{mode}: turn {turn} prefill forward pass on / off", ratio, "x")
                for turn, ratio in s["prefill_ratio_on_off"].items()]
    return out


def print_table(summary: dict[str, dict]) -> None:
    print_header(f"{'mode':<11}{'turn':>5}{'prompt':>8}{'cached':>8}{'TTFT on':>10}{'TTFT off':>10}{'on/off':>8}"
                 f"{'P fwd on':>10}{'P fwd off':>10}{'on/off':>8}")
    for mode, s in summary.items():
        for turn, ratio in s["ratio_on_off"].items():
            on, off = s["on"][turn], s["off"][turn]
            forward = (f"{on['prefill_ms_median']:>10.1f}{off['prefill_ms_median']:>10.1f}"
                       f"{s['prefill_ratio_on_off'][turn]:>7.2f}x") if turn in s["prefill_ratio_on_off"] else ""
            print(f"{mode:<11}{turn:>5}{on['prompt_tokens']:>8.0f}{on['cached_tokens']:>8.0f}"
                  f"{on['ttft_ms_median']:>10.1f}{off['ttft_ms_median']:>10.1f}{ratio:>7.2f}x{forward}")
        print(f"{mode}: worst on/off from turn {GOAL_FROM_TURN}: {s['worst_ratio_from_turn_3']}x (goal <= {GOAL_RATIO}: "
              f"{'met' if s['goal_met'] else 'NOT met'}); same texts on and off: {'yes' if s['same_texts'] else 'NO'}")
        print()
    print("TTFT in ms (medians): send -> first SSE chunk with content, through the router; P fwd (epd): the "
          "prefill's forward pass, its room timeline's prefilled - embeddings_ready")


def plot(summary: dict[str, dict], path: Path, title: str) -> None:
    """One panel per mode: TTFT median per turn, on and off side by side, on / off over the bars."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(summary), figsize=(5.0 * len(summary), 4.2), squeeze=False)
    for ax, (mode, s) in zip(axes[0], summary.items()):
        turns = list(s["ratio_on_off"])
        for offset, side, color in ((-0.2, "off", "grey"), (0.2, "on", "tab:blue")):
            ax.bar([t + offset for t in turns], [s[side][t]["ttft_ms_median"] for t in turns], 0.4, color=color,
                   label=f"prefix caching {side}")
        for t in turns:
            top = max(s["on"][t]["ttft_ms_median"], s["off"][t]["ttft_ms_median"])
            ax.text(t, top, f"{s['ratio_on_off'][t]:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(turns, [f"turn {t}\n{s['on'][t]['prompt_tokens']:.0f} tok" for t in turns], fontsize=8)
        ax.set_title(mode, fontsize=9)
        ax.set_ylabel("TTFT ms (median)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
