"""What a run shows: the table, the plot and the summary's headline figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure
from bench.prefill_overlap.analysis import GOALS


def figures(summary: dict, counts: list[int]) -> list[Figure]:
    """Per N: each system's TTFT median, the two ratios (with their goals), the prefill's overlap medians."""
    out = []
    for n in counts:
        key = str(n)
        out += [Figure(f"{n} images: TTFT p50, {system}", per[key]["ttft_ms"].get("median"), "ms")
                for system, per in summary["systems"].items()]
        out += [Figure(f"{n} images: TTFT {name} (goal {GOALS[name]}x)", by_n[key], "x")
                for name, by_n in summary["ratios"].items()]
        overlap = summary["systems"].get("overlap", {}).get(key)
        if overlap is not None and "computed_tokens_median" in overlap:
            out += [Figure(f"{n} images: overlap, prompt tokens computed when the last embedding came",
                           overlap["computed_tokens_median"], "tokens"),
                    Figure(f"{n} images: overlap, in the engine when the last embedding came",
                           overlap["overlap_ms_median"], "ms")]
    return out


def print_table(summary: dict, counts: list[int]) -> None:
    """Per N and system: TTFT median, p90, min, the ratios, the prefill's overlap figures, the encoder's time."""
    print_header(f"{'images':>6}{'prompt':>7}  {'system':<11}{'TTFT p50':>9}{'p90':>8}{'min':>8}{'/no_ovl':>9}"
                 f"{'/coloc':>8}{'computed':>9}{'ovl ms':>8}{'P wait':>8}{'P fwd ms':>9}{'enc ms':>8}")
    systems = summary["systems"]
    for n in counts:
        key = str(n)
        for i, (system, per) in enumerate(systems.items()):
            s = per[key]
            t = s["ttft_ms"]
            no = systems.get("no_overlap", {}).get(key, {}).get("ttft_ms", {}).get("median")
            co = systems.get("colocated", {}).get(key, {}).get("ttft_ms", {}).get("median")
            vs_no = f"{t['median'] / no:.2f}x" if no and system != "no_overlap" else ""
            vs_co = f"{t['median'] / co:.2f}x" if co and system != "colocated" else ""

            def cell(name: str, width: int) -> str:
                value = s.get(name)
                return f"{'' if value is None else f'{value:.1f}':>{width}}"

            lead = f"{n:>6}{s['prompt_tokens'] or 0:>7}" if i == 0 else " " * 13
            print(f"{lead}  {system:<11}{t['median']:>9.1f}{t['p90']:>8.1f}{t['min']:>8.1f}{vs_no:>9}{vs_co:>8}"
                  f"{cell('computed_tokens_median', 9)}{cell('overlap_ms_median', 8)}"
                  f"{cell('wait_ms_median', 8)}{cell('forward_ms_median', 9)}{cell('encode_ms_median', 8)}")
        print()
    print("TTFT in ms through the router (medians); goals: overlap/no_overlap <= 0.75x, overlap/colocated <= 1.0x.\n"
          "computed: prompt tokens the prefill had computed when the last embedding came (embeddings_ready); "
          "ovl ms: how long its request had been in the engine by then;\nP wait: queued -> embeddings_ready "
          "without overlap; P fwd ms: in the engine -> prefilled; "
          f"enc ms: the encoder's queued -> last encoded (medians). same text as overlap: {summary['same_text']}")


def plot(summary: dict, counts: list[int], path: Path, title: str) -> None:
    """TTFT median per N, a bar per system (to p90), the ratios written over overlap's bar."""
    plt = pyplot()
    colors = {"colocated": "grey", "overlap": "tab:green", "no_overlap": "tab:red"}
    systems = list(summary["systems"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        for i, n in enumerate(counts):
            t = summary["systems"][system][str(n)]["ttft_ms"]
            x = i + (j - (len(systems) - 1) / 2) * width
            ax.bar(x, t["median"], width, yerr=[[0], [t["p90"] - t["median"]]], capsize=3, color=colors.get(system),
                   label=system if i == 0 else None)
            if system == "overlap":
                text = "\n".join(f"{v[str(n)]:.2f}x" for v in summary["ratios"].values() if v[str(n)] is not None)
                ax.text(x, t["median"] * 1.02, text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(counts)), [f"{n} images" for n in counts])
    ax.set_ylabel("TTFT ms (median, bar to p90)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=8)
    save_figure(fig, path)
