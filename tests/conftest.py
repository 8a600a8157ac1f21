import os

# Short waits so that fault tests finish quickly; tests that need more pass timeout=.
os.environ.setdefault("SYMHEAP_TIMEOUT", "30")
os.environ.setdefault("SYMHEAP_BACKEND", "cpu")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
