"""Redis leadership history: a history key of another type refuses the acquisition
before the script writes anything (Redis undoes nothing of a script that fails half
way), so no lease is left half taken and the error says what to do."""

from __future__ import annotations

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
