"""Loader worker processes: lanes produced in other processes, handed over in shared memory.

* :mod:`loader.workers.pool`     the trainer's side: start early, feed runs, read slots, shut down
* :mod:`loader.workers.child`    the worker's side: produce a run's items into free slots
* :mod:`loader.workers.messages` what one message holds, and the slot lease
* :mod:`loader.workers.shm`      the shared-memory segment of slots, and why it cannot leak
"""
