"""The pytest glue: the plugin and everything only a pytest session needs.

The layers, from the top: this package talks to pytest (options and ini
settings, markers, reports, JUnit and JSON output, baselines, annotations,
traces); below it, :mod:`pytest_torchperf.engine` and
:mod:`pytest_torchperf.core` watch a run, the probes patch torch, and the
invariants judge. Nothing below imports from here, except the one trace switch
``no_debug_modes`` reads.

- :mod:`.plugin`: pytest's hooks and fixtures (the ``pytest11`` entry point);
- :mod:`.settings`: options and ini values, resolved once per session;
- :mod:`.project`: the project's own packages, for frame attribution;
- :mod:`.adoption`: the baseline, annotations and traces around a test;
- :mod:`.baseline`, :mod:`.github`, :mod:`.trace`: those three, each alone;
- :mod:`.results`: the JSON document and the JUnit properties;
- :mod:`.ci`: what a CI run prints and writes at the end;
- :mod:`.summary`: the terminal summary;
- :mod:`.unchecked`: what to do about invariants that could not be checked.
"""
