"""gezel-trio's measurements: declarative scenarios and one harness.

Run from the repository root with the virtual environment active::

    python -m bench --list                  # the scenarios
    python -m bench decode --size tiny --quick
    python -m bench                         # every scenario of the default run

Each run writes ``bench/results/<scenario>.json`` (settings and raw data),
``<scenario>.md`` (tables, notes, what the scenario measures) and
``<scenario>.png`` (its main curves).

The harness, one module per concern:

``_scenario``  what a scenario declares (``Scenario``, ``Option``) and returns
               (``Result`` with ``Table`` and ``Plot``);
``_servers``   starting and stopping gezel-trio and ``mlx_lm.server``, the models;
``_sse``       the streaming client and its timings, the decode metric;
``_worker``    in-process MLX measurements in a child process;
``_report``    the JSON, markdown and PNG files;
``_cli``       ``python -m bench``.

A scenario is a module of ``bench/scenarios/`` that defines ``SCENARIO``;
adding one needs no other change. A stand-alone script becomes one by moving
its argparse flags into ``Option`` declarations (with ``--quick`` values),
its ``main`` into ``run(ctx) -> Result``, its servers and streams onto
``_servers`` and ``_sse``, and its module docstring, unchanged, into the
scenario's ``doc``; a long run (a soak) says ``in_default_run=False``.
"""
