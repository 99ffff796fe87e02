import sys
from pathlib import Path

from moed.daemon.bench.bench_model import bench_config, write_bench_model

write_bench_model(Path(sys.argv[1]), bench_config(8, 2048, 512, 256, 8, 8192, bits=4, group=64), "float32", 0)
