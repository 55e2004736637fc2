"""txbox's development tools: benchmarks, the chaos run and the demo (`txbox bench|chaos|demo`).

A distribution of its own (``txbox-tools``, in the repository's ``tools/`` folder), so the
``txbox`` wheel holds only the library and the operator commands. The ``txbox`` command
finds these commands through the ``txbox.commands`` entry-point group
(docs/explanation/development.md, "The development tools").
"""
