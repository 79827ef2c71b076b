"""Chat templates that read the clock or never end (issue 28, classes 2 and 4).

Every hostile template is a ``ChatTemplateError`` naming the template, within seconds, on
both render paths (plain and generation-tracking): never a silent difference between two runs
(``strftime_now``), a hang (nested loops), or a bare ``MemoryError`` / ``RecursionError`` /
``OverflowError``. A template that guards ``strftime_now`` renders its own fixed fallback, the
same on every run. The Beam job refuses a clock-reading template with one error line.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from beam_jobs import shard
from loader.chat.template import ChatTemplate, ChatTemplateError
from loader.cli import run_command

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
HOSTILE = {
    "clock": ("{{ strftime_now('%Y-%m-%d %H:%M:%S.%f') }}", "strftime_now"),
    "clock_in_set": ("{% set now = strftime_now('%d %b %Y') %}{{ now }}", "strftime_now"),
    "clock_in_generation": ("{% for m in messages %}{% generation %}{{ strftime_now('%f') }}{% endgeneration %}"
                            "{% endfor %}", "strftime_now"),
    "nested_loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "loop steps"),
    "triple_loops": ("{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
                     "{% endfor %}{% endfor %}{% endfor %}", "loop steps"),
    "huge_range": ("{% for i in range(10**7) %}{% endfor %}", "range"),
    "string_times_huge": ('{{ "x" * 10**10 }}', "builds a str"),
    "huge_times_string": ('{{ 10**10 * "x" }}', "builds a str"),
    "list_times_huge": ("{{ ([1] * 10**9) | length }}", "builds a list"),
    "power_of_power": ("{{ (2 ** 64) ** 1000 }}", "digits"),
    "power_in_loop": ("{% set ns = namespace(x=7) %}{% for i in range(40) %}{% set ns.x = ns.x ** 2 %}{% endfor %}"
                      "{{ ns.x }}", "digits"),
    "power_huge": ("{{ 10 ** 100000 }}", "digits"),
    "recursive_macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deep"),
    "output_flood": ('{% for i in range(100000) %}{{ "y" * 1000 }}{% endfor %}', "characters"),
    "output_flood_messages": ('{% for m in messages %}{% for i in range(100000) %}{{ "z" * 200 }}{% endfor %}'
                              "{% endfor %}", "characters"),
}


@pytest.mark.parametrize("track", [False, True], ids=["plain", "tracked"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_template_is_a_template_error_within_seconds(case, track):
    source, must_say = HOSTILE[case]
    template = ChatTemplate.from_string(source, origin=f"hostile-{case}.jinja")
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=rf"hostile-{case}\.jinja.*{must_say}"):
        template.render(MESSAGES, track_generation=track)
    assert time.monotonic() - started < 15


def test_a_guarded_clock_renders_the_templates_fallback_every_time():
    source = ("{% if strftime_now is defined %}{{ strftime_now('%f') }}{% else %}26 Jul 2024{% endif %}"
              "{% for i in range(3) %}{{ loop.length }}{{ i }}{% endfor %}{{ range(4) | length }}")
    renders = {ChatTemplate.from_string(source).render(MESSAGES).text for _ in range(5)}
    assert renders == {"26 Jul 20243031324"}


def test_the_beam_job_refuses_a_clock_reading_template_with_one_line(tmp_path, capsys):
    (tmp_path / "clock.jinja").write_text(
        "{% for m in messages %}{{ m.role }} {{ strftime_now('%H:%M:%S') }}: "
        "{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(4)))
    code = run_command("shard", ["--input", str(tmp_path / "chat.jsonl"), "--output", str(tmp_path / "out"),
                                 "--messages-field", "messages", "--chat-template", str(tmp_path / "clock.jinja"),
                                 "--num-lanes", "1", "--runner=FnApiRunner", "--direct_running_mode=in_memory"],
                       debug=False)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("zephon shard: error:")]
    assert code != 0 and len(err) == 1 and "strftime_now" in err[0], err
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_memory", "multi_processing"])
def test_a_failed_job_ends_with_one_zephon_error_line_in_every_running_mode(tmp_path, mode):
    """The CLI in a subprocess (Beam's own logging as a user gets it): exit 1, the last line of
    stderr is the one ``zephon shard: error:`` line, and Beam logs no ERROR record itself."""
    import subprocess
    import sys

    (tmp_path / "clock.jinja").write_text(
        "{% for m in messages %}{{ m.role }} {{ strftime_now('%H') }}: "
        "{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(4)))
    runner = ["--runner=FnApiRunner", f"--direct_running_mode={mode}"] + (
        ["--direct_num_workers=2"] if mode == "multi_processing" else [])
    done = subprocess.run([sys.executable, "-m", "loader.cli", "shard", "--input", str(tmp_path / "chat.jsonl"),
                           "--output", str(tmp_path / "out"), "--messages-field", "messages", "--chat-template",
                           str(tmp_path / "clock.jinja"), "--num-lanes", "1", *runner],
                          capture_output=True, text=True, timeout=150, env={**os.environ, "ZEPHON_DEBUG": ""})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr[-2000:]
    assert lines[-1].startswith("zephon shard: error:") and "strftime_now" in lines[-1], lines[-5:]
    assert sum(line.startswith("zephon shard: error:") for line in lines) == 1
    assert not any(line.startswith("ERROR apache_beam") for line in lines)
    assert not any(line.startswith("Traceback") for line in lines), lines[:5]  # workers' own prints too
    if mode == "multi_processing":  # the workers' tracebacks are what --debug adds back
        debug = subprocess.run(done.args, capture_output=True, text=True, timeout=150,
                               env={**os.environ, "ZEPHON_DEBUG": "1"})
        assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
