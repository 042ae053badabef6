package poolsim

import (
	"strings"
	"testing"
)

const MiB = 1 << 20

func TestSimulate(t *testing.T) {
	cases := []struct {
		name     string
		trace    string
		peak     int64
		perPool  map[string]int64 // peak reserved per pool
		finalRes map[string]int64
	}{
		{
			name:    "pools do not share free blocks",
			trace:   "a 1 64000000 d\nf 1\na 2 64000000 g\nf 2\na 3 64000000 w\n",
			peak:    3 * 62 * MiB,
			perPool: map[string]int64{"d": 62 * MiB, "g": 62 * MiB, "w": 62 * MiB},
		},
		{
			name:    "a block fits a hole of its size in its own pool",
			trace:   "a 1 67108864 d\na 2 67108864 d\nf 1\na 3 33554432 d\na 4 33554432 d\n",
			peak:    128 * MiB,
			perPool: map[string]int64{"d": 128 * MiB},
		},
		{
			name:    "a packed 64 MiB + 16 KiB block misses a 64 MiB hole",
			trace:   "a 1 67108864 d\na 2 67108864 d\nf 1\na 3 67125248 d\n",
			peak:    194 * MiB,
			perPool: map[string]int64{"d": 194 * MiB},
		},
		{
			name:     "empty_cache gives back the default pools' free segments, not the graph pool's",
			trace:    "a 1 67108864 w\nf 1\na 2 67108864 g\nf 2\ne\na 3 67108864 d\n",
			peak:     128 * MiB,
			perPool:  map[string]int64{"w": 64 * MiB, "g": 64 * MiB, "d": 64 * MiB},
			finalRes: map[string]int64{"w": 0, "g": 64 * MiB, "d": 64 * MiB},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, err := Simulate(c.trace)
			if err != nil {
				t.Fatal(err)
			}
			if r.PeakReserved != c.peak {
				t.Errorf("peak reserved %d MiB, want %d MiB", r.PeakReserved/MiB, c.peak/MiB)
			}
			for p, want := range c.perPool {
				if got := r.Pool[p].PeakReserved; got != want {
					t.Errorf("pool %s peak reserved %d MiB, want %d MiB", p, got/MiB, want/MiB)
				}
			}
			for p, want := range c.finalRes {
				if got := r.Pool[p].Reserved; got != want {
					t.Errorf("pool %s reserved at the end %d MiB, want %d MiB", p, got/MiB, want/MiB)
				}
			}
		})
	}
}

func TestErrorsNameTheLine(t *testing.T) {
	cases := map[string]string{
		"a 1 10 x\n":         "unknown pool",
		"a 1 10 d\na 1 10 d": "already live",
		"f 7\n":              "not live",
		"a -1 10 d\n":        "bad allocation id",
		"a 1 -5 d\n":         "bad size",
		"zap\n":              "not an event",
	}
	for trace, want := range cases {
		_, err := Simulate(trace)
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "line") {
			t.Errorf("%q: error %v, want one naming the line and %q", trace, err, want)
		}
	}
}

func TestEncode(t *testing.T) {
	r, err := Simulate("a 1 1000 d\n")
	if err != nil {
		t.Fatal(err)
	}
	want := "peak_reserved 2097152\npeak_allocated 1024\npool d reserved 2097152 peak_reserved 2097152 peak_allocated 1024 segments 1\n" +
		"pool w reserved 0 peak_reserved 0 peak_allocated 0 segments 0\npool g reserved 0 peak_reserved 0 peak_allocated 0 segments 0\n"
	if got := r.Encode(); got != want {
		t.Errorf("Encode:\n%s\nwant\n%s", got, want)
	}
}

func FuzzSimulate(f *testing.F) {
	f.Add("a 1 64000000 d\nf 1\na 2 1000 g\ne\nf 2\n")
	f.Add("a 0 0 w\na 1 12582912 w\nf 0\n")
	f.Fuzz(func(t *testing.T, trace string) {
		r, err := Simulate(trace)
		if err != nil {
			return
		}
		var sum int64
		for _, p := range Pools {
			pr := r.Pool[p]
			if pr.Reserved < 0 || pr.Reserved > pr.PeakReserved || pr.PeakAllocated > pr.PeakReserved {
				t.Fatalf("pool %s inconsistent: %+v", p, pr)
			}
			sum += pr.PeakReserved
		}
		if r.PeakReserved > sum || r.PeakAllocated > r.PeakReserved {
			t.Fatalf("totals inconsistent: %+v", r)
		}
	})
}
