"""The built-in weight-sync backends, one module each (``shm``, ``zmq``, ``broadcast``, ``disk``).

Every public module here registers one backend with ``checkpointengine.backend.register_backend`` and is
imported when a backend is first looked up; modules starting with ``_`` are shared helpers.
"""
