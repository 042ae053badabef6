package gograph

import (
	"os"
	"runtime"
)

// The core is called from Python's thread between stretches of Python
// work. With one processor (GOMAXPROCS 1, which the runtime takes from a
// process pinned to one core) the runtime retakes it from that thread while
// the thread runs C, and the monitor thread keeps waking on the same core:
// each call then costs ~4 µs instead of ~1 (bench/host_path.py under
// `taskset -c 1`). A second, idle processor lets the calling thread keep
// its own. A GOMAXPROCS the user set is left alone.
func init() {
	if n := processors(os.Getenv("GOMAXPROCS"), runtime.GOMAXPROCS(0)); n > 0 {
		runtime.GOMAXPROCS(n)
	}
}

// processors is the GOMAXPROCS to set given the environment's value and
// the current one: 2 where the runtime chose fewer by itself, 0 (leave it)
// otherwise.
func processors(env string, current int) int {
	if env != "" || current >= 2 {
		return 0
	}
	return 2
}
