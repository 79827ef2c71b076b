"""The ``zephon`` subcommands that live in the loader (the Beam ones are in ``beam_jobs``).

Each module has ``main(argv)``; :mod:`loader.cli` dispatches to them and reports errors.
"""
