"""The benchmarks' summaries and bench/README.md's "Latest figures" table: the table is exactly what
the committed summaries render to, every committed summary is valid and named by its configuration,
and the pure parts of bench.common.record and bench.summaries; a Recorder writes both files."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common.record import DEFAULT, Figure, Recorder, build_summary, configuration, problems, summary_name
from bench.summaries import BEGIN, END, FOLDER, NONE_YET, README, format_value, load, render, splice

REPO = Path(__file__).resolve().parents[2]
MACHINE = {"cpu": "AMD EPYC", "cpu_count": 2, "mem_gib": 23.5, "git_commit": "abc1234", "git_dirty": True,
           "platform": "not kept"}


def summary(benchmark: str = "epd_cache", config: str = DEFAULT, figures=(Figure("TTFT hit / miss", 0.42, "x"),)):
    return build_summary(benchmark=benchmark, config=config, command=f"python -m bench.{benchmark}",
                         started=1_764_633_600.0, machine=MACHINE, load={"min": 0.4, "max": 1.25, "samples": 3},
                         duration_s=12.34, full_results=f"bench/results/{benchmark}.json", figures=figures)


# --- the committed summaries and the README ------------------------------------------------------
@pytest.mark.unit
def test_the_readme_table_is_what_the_committed_summaries_render_to():
    text = README.read_text()
    assert splice(text, render(load())) == text, "run: .venv/bin/python -m bench.summaries --write-readme"


@pytest.mark.unit
def test_every_committed_summary_is_valid_and_named_by_its_configuration():
    for path in sorted(FOLDER.glob("*.json")):
        s = json.loads(path.read_text())
        assert problems(s) == [], path.name
        assert path.name == summary_name(s["benchmark"], s["configuration"])


def test_the_check_command_agrees_with_the_readme():
    done = subprocess.run([sys.executable, "-m", "bench.summaries", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{README}: the table matches {len(load())} summaries")


# --- configuration and names ---------------------------------------------------------------------
@pytest.mark.unit
def test_configuration_lists_the_flags_that_differ_from_the_defaults():
    defaults = {"quick": False, "image_size": 224, "out": "a.json", "summary_dir": "s", "images": "1,4,8",
                "pin": []}
    assert configuration(defaults, dict(defaults)) == DEFAULT
    given = {**defaults, "quick": True, "image_size": 448, "out": "elsewhere.json", "summary_dir": "/tmp/x"}
    assert configuration(defaults, given) == "image_size=448,quick"
    assert configuration(defaults, {**defaults, "pin": ["decode=1", "prefill=0"]}) == "pin=decode=1;prefill=0"


@pytest.mark.unit
def test_summary_name_is_safe_and_bounded():
    assert summary_name("ttft_pd", DEFAULT) == "ttft_pd.json"
    assert summary_name("epd_cache", "image_size=448,quick") == "epd_cache--image_size=448,quick.json"
    assert summary_name("compare", "model=/root/m s") == "compare--model=_root_m_s.json"
    long = ",".join(f"flag{i}=value{i}" for i in range(20))
    name = summary_name("compare", long)
    assert len(name) == len("compare--") + 64 + len(".json")
    assert name != summary_name("compare", long + "x")  # the hash tells two long ones apart


# --- the summary's format ------------------------------------------------------------------------
@pytest.mark.unit
def test_build_summary_keeps_the_machine_commit_dirty_flag_and_figures():
    s = summary(figures=(Figure("TTFT hit / miss", 0.42, "x"), Figure("wake p50", None, "ms")))
    assert s == {"benchmark": "epd_cache", "configuration": "default", "command": "python -m bench.epd_cache",
                 "date": "2025-12-02", "commit": "abc1234", "dirty": True,
                 "machine": {"cpu": "AMD EPYC", "cpu_count": 2, "mem_gib": 23.5},
                 "load_1m": {"min": 0.4, "max": 1.25, "samples": 3}, "duration_s": 12.3,
                 "full_results": "bench/results/epd_cache.json",
                 "figures": [{"name": "TTFT hit / miss", "value": 0.42, "unit": "x"},
                             {"name": "wake p50", "value": None, "unit": "ms"}]}
    assert problems(s) == []


@pytest.mark.unit
@pytest.mark.parametrize("change, expected", [
    ({"commit": 5}, ["commit: missing or not (<class 'str'>, <class 'NoneType'>)"]),
    ({"dirty": "yes"}, ["dirty: missing or not (<class 'bool'>, <class 'NoneType'>)"]),
    ({"load_1m": None}, ["load_1m: missing or not <class 'dict'>"]),
    ({"figures": []}, ["figures: none"]),
    ({"figures": [{"name": "x", "value": "fast", "unit": "ms"}]}, ["figures[0] 'x': value is not a number"]),
    ({"figures": [{"name": "x", "value": True, "unit": "x"}]}, ["figures[0] 'x': value is not a number"]),
    ({"figures": [{"name": "", "value": 1, "unit": "x"}]}, ["figures[0]: needs a name and a unit"]),
])
def test_problems_names_what_is_wrong(change, expected):
    assert problems({**summary(), **change}) == expected


# --- the table -----------------------------------------------------------------------------------
@pytest.mark.unit
def test_render_orders_summaries_and_formats_values():
    rows = render([summary("ttft_pd", "quick", (Figure("text_short: TTFT pd-nixl / colocated", 1.254, "x"),)),
                   summary("epd_cache", "image_size=448", (Figure("wake p50", 1.9034, "ms"),)),
                   summary("ttft_pd", DEFAULT, (Figure("a|b", None, "ms"),))]).splitlines()
    assert rows[0].startswith("| benchmark | configuration | figure | value |")
    assert rows[2:] == [
        "| `epd_cache` | image_size=448 | wake p50 | 1.903 ms | 0.4-1.25 | AMD EPYC, 2 cores | 2025-12-02 | abc1234 (dirty) |",
        "| `ttft_pd` | default | a\\|b | n/a | 0.4-1.25 | AMD EPYC, 2 cores | 2025-12-02 | abc1234 (dirty) |",
        "| `ttft_pd` | quick | text_short: TTFT pd-nixl / colocated | 1.254x | 0.4-1.25 | AMD EPYC, 2 cores | "
        "2025-12-02 | abc1234 (dirty) |"]
    assert render([]) == NONE_YET


@pytest.mark.unit
def test_format_value():
    assert (format_value(0.4249, "x"), format_value(216.94, "tok/s"), format_value(None, "ms")) == \
        ("0.4249x", "216.9 tok/s", "n/a")


@pytest.mark.unit
def test_splice_replaces_only_the_block_between_the_markers():
    readme = f"# B\n\ntext\n{BEGIN}\nold table\nmore\n{END}\n\nafter\n"
    assert splice(readme, "NEW") == f"# B\n\ntext\n{BEGIN}\nNEW\n{END}\n\nafter\n"
    for broken in ("no markers\n", f"{END}\n{BEGIN}\n", f"{BEGIN}\n{BEGIN}\n{END}\n"):
        with pytest.raises(ValueError, match="needs the lines"):
            splice(broken, "NEW")


# --- a Recorder writes the report and the summary ------------------------------------------------
def test_a_recorder_writes_the_full_report_and_a_valid_summary(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--summary-dir", default="unused")
    args = parser.parse_args(["--rounds", "3", "--summary-dir", str(tmp_path / "summaries")])
    record = Recorder.of_script("ttft_pd", parser, args, ["--rounds", "3"])
    out = tmp_path / "results" / "ttft_pd.json"
    path = record.finish(out, {"benchmark": "ttft_pd", "results": [1]}, [Figure("TTFT pd / colocated", 1.1, "x")])
    assert path == tmp_path / "summaries" / "ttft_pd--rounds=3.json"
    written = json.loads(path.read_text())
    assert problems(written) == []
    assert (written["configuration"], written["command"]) == ("rounds=3", "python -m bench.ttft_pd --rounds 3")
    assert written["full_results"] == str(out) and written["load_1m"]["samples"] >= 2
    report = json.loads(out.read_text())
    assert report["results"] == [1] and report["machine"]["git_commit"] == written["commit"]
    assert report["machine"]["git_dirty"] == written["dirty"] and "total_s" in report


def test_a_run_that_failed_its_checks_or_measured_nothing_writes_no_summary(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--summary-dir", default=str(tmp_path / "summaries"))
    record = Recorder.of_script("router_overhead", parser, parser.parse_args([]), [])
    assert record.finish(tmp_path / "r.json", {"results": {}}, None) is None
    assert (tmp_path / "r.json").exists() and not (tmp_path / "summaries").exists()
    nothing = Recorder.of_script("epd_cache", parser, parser.parse_args([]), [])
    assert nothing.finish(tmp_path / "e.json", {"summary": {}}, []) is None  # no figures measured
    assert not (tmp_path / "summaries").exists()


def test_a_checkout_is_dirty_for_any_change_but_the_runs_own_summaries(tmp_path, monkeypatch):
    from bench.common import machine

    def git(*argv: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=tmp_path, check=True,
                       capture_output=True, timeout=30)

    git("init", "-q")
    (tmp_path / "bench" / "summaries").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "start")
    monkeypatch.setattr(machine, "REPO", tmp_path)
    assert machine.git_dirty() is False
    (tmp_path / "bench" / "summaries" / "kv_transfer.json").write_text("{}")
    assert machine.git_dirty() is False  # an earlier run's summary
    (tmp_path / "code.py").write_text("x = 2\n")
    assert machine.git_dirty() is True
