"""Restarts without loss: the state each step leaves behind, and where a (re)started job takes it from.

- ``staging``     the per-step staged copy in node memory (``Stager``: overlapped with the next step)
- ``run_token``   a run's ids on a node (``run_id``: its path; ``staging_id``: its path and token) and its token
- ``restore``     the choice of the source a (re)started job restores (staged copy or durable checkpoint), and the restore
- ``lineage``     which start of the job this process is: the agent's rendezvous round, restarts, the run's lineage
- ``resume``      the plan a resumed job runs in, chosen before any worker starts
- ``job_record``  the job's record in the store: its plans, transitions and starts
- ``run_lock``    one job per run dir: the exclusive ``flock`` on ``RUN_DIR/.lock`` and who holds it
- ``lock_record`` the run dir lock's record, whether an acquirer waits for its holder, and its one-line messages
- ``lock_holders`` who holds a lock file on this host, from ``/proc`` (a refusal names them)
- ``phases``      phase marks for fault injection from outside (``NEREUS_PHASE_LOG``; off otherwise)

Nothing here imports ``runtime/``: the trainer comes in as an argument.
"""
