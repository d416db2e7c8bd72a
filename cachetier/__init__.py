"""cachetier: the control plane's processes and their faces, one room per folder.

The shared base (`config`, `errors`) and the wire (`wire/`) sit under the low packages
(`index/`, `gpu_pool/`, `kernels/`, `eviction/`, `tinymodel/`); above them the service
(`service/`), MQTT (`events/`), the scheduler's client (`client`) and a scheduler (`engine/`);
then the runners (`run/`, `replay/`, `bench/`) and the CLI (`cli`). Imports run downwards only
(`tests/test_layers.py`). Nothing here touches Redis keys except through `index`, nor pool bytes
except through `gpu_pool` and `kernels`.
"""
