"""The checkpoint format's name and version: the bottom of :mod:`loader.checkpoint`.

:mod:`~loader.checkpoint.migrations` and :mod:`~loader.checkpoint.schema` read these, and
:mod:`~loader.checkpoint.state` uses both of them, so the constants live below all three.
"""

STATE_FORMAT = "zephon.loader_state"
STATE_VERSION = 3  # 2: best-fit bins hold piece_origins; 3: text cursors their document (loader.checkpoint.migrations)
