"""(tests/test_joint_flush.py) Slow durable storage for the persister processes: each rank file's
write takes SLOW_PERSISTER_WRITE_S longer, as a large file's upload would."""

import os

_delay = os.environ.get("SLOW_PERSISTER_WRITE_S")
if _delay and os.environ.get("RESILIENT_PERSISTER_PROCESS") == "1":
    import time

    from resilient.checkpoint import storage as _storage

    _write_file = _storage.Storage.write_file

    def _slow(self, rel, *args, **kwargs):
        if "/rank_" in rel and self.is_local:
            time.sleep(float(_delay))
        return _write_file(self, rel, *args, **kwargs)

    _storage.Storage.write_file = _slow
