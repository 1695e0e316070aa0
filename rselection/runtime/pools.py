"""The process's thread pools, shared by every term (each term has lanes of its own).

Claims, the look-back for missed fires and off-thread preparations run on one pool;
clean-ups of expired claims on another (so that one never holds up a claim); signals
sent off the caller's thread on a third. Workers start on demand; a call running for a
second counts as stuck and lets the pool start one more, up to ``most`` (see
:class:`~rselection.daemon_pool.SharedPool`). So a term whose claims hang on a dead
connection holds two workers, and the others' claims go on.
"""

from __future__ import annotations

from ..daemon_pool import SharedPool

__all__ = ["CLAIM_POOL", "CLEANUP_POOL", "SHARED_POOLS", "SIGNAL_POOL"]

CLAIM_POOL = SharedPool("rselection-claims", 4, most=32)
"""Claims, the look-back for missed fires, and preparations of fires off the scheduler."""
CLEANUP_POOL = SharedPool("rselection-cleanup", 1, most=4)
"""Clean-ups of expired claims."""
SIGNAL_POOL = SharedPool("rselection-signals", 2, most=8)
"""Signal receivers that must not run on the caller's thread."""
SHARED_POOLS = (CLAIM_POOL, CLEANUP_POOL, SIGNAL_POOL)
"""Every pool above, to wait for when the last term ends."""
