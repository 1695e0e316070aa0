"""Redis leadership history and drains: a history key of another type refuses the
acquisition before the script writes anything (Redis undoes nothing of a script that
fails half way), so no lease is left half taken and the error says what to do; and a
node whose ACL may not read the drained nodes still leads."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from rselection.errors import BackendUnavailable
from rselection.redis import RedisLease
from rselection.redis.keys import history_key, lease_keys


def test_a_history_key_of_another_type_refuses_the_acquisition_and_writes_nothing(
    redis_url: str, redis_prefix: str
) -> None:
    prefix = redis_prefix
    client = redis.Redis.from_url(redis_url)
    lease = RedisLease(redis_url, name="jobs", key_prefix=prefix, ttl=3.0, renew_deadline=2.0)
    try:
        client.set(history_key("jobs", prefix), "not a stream")
        lease.connect()
        with pytest.raises(BackendUnavailable, match=r"history key .* not a stream: delete it"):
            lease.try_acquire("a")
        key, term_key, _ = lease_keys("jobs", prefix)
        assert client.exists(key, term_key) == 0  # no lease value, no term counted
        client.delete(history_key("jobs", prefix))
        assert lease.try_acquire("a").acquired
    finally:
        lease.close()
        client.close()


def test_a_node_whose_acl_may_not_read_the_drains_still_leads(private_redis: Any) -> None:
    """A Redis user set up before drains existed (no set commands) must keep leading,
    as one that cannot be drained: its connect reads the drains first."""
    from rselection import TaskHandler
    from rselection.redis import RedisLeader

    admin = redis.Redis.from_url(private_redis.url)
    admin.execute_command("ACL", "SETUSER", "nosets", "on", ">pw", "~*", "&*", "+@all", "-@set")
    url = f"redis://nosets:pw@127.0.0.1:{private_redis.port}/0"
    leader = RedisLeader(
        url,
        TaskHandler(),
        name="jobs",
        ttl=3,
        renew_interval=0.5,
        renew_deadline=2,
        retry_interval=0.5,
    )
    try:
        leader.start()
        assert leader.wait_until_leader(10)
    finally:
        leader.stop(timeout=10)
        admin.close()
