"""``python -m megatron_ft.redundancy.codecs``: say which codecs work here (and where ISA-L came from)."""
import json

from .factory import codec_status

if __name__ == "__main__":
    print(json.dumps(codec_status(), indent=1))
