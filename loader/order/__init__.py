"""Order: which global index, lane, source and rank every sequence has. Pure integer math, no I/O.

* :mod:`loader.order.hashing`       stable hashes shared with the Beam job (lane of a key, order in a lane)
* :mod:`loader.order.ordering`      global index -> lane, step, rank, worker; epoch permutations
* :mod:`loader.order.mixing`        which source the sequence at a global index comes from
* :mod:`loader.order.data_parallel` which data-parallel rank a loader serves (arguments, DeviceMesh, env)
* :mod:`loader.order.packing_windows` best-fit-decreasing inside a packing window (``packing_window``)
* :mod:`loader.order.balance`       a step's sequences to ranks and micro-batches by cost (``balance``)
"""
