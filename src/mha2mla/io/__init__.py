"""Input and output shared by every part: model sources (sources.py), tensor readers and the shard writer
(readers.py), checkpoint files (checkpoint.py), atomic writes (atomic.py), text → token blocks (text.py)."""
