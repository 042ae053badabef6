package lifetime

import (
	"math/rand"
	"reflect"
	"strings"
	"testing"

	"github.com/gograph/gograph/internal/schedule"
)

func TestReuseSampleEntries(t *testing.T) {
	tests := []struct {
		name   string
		p      *schedule.Plan
		keys   []int
		chain  bool
		want   []int
		errMsg string
	}{
		{"one layer: the third microbatch takes the first's entry once its backward ran",
			plan(t, []float64{1, 1, -1, 1, -1, -1}, "1", 1, 3), []int{0, 0, 0}, false, []int{0, 1, 0}, ""},
		{"two layers: a backward entry frees its microbatch's entries in forward order",
			plan(t, []float64{1, 1, -1, 1, -1, -1}, "2", 2, 6), []int{0, 0, 0, 0, 0, 0}, false, []int{0, 1, 2, 3, 0, 1}, ""},
		{"keys must match: a layer takes only its own layer's entries",
			plan(t, []float64{1, 1, -1, 1, -1, -1}, "2", 2, 6), []int{0, 1, 0, 1, 0, 1}, false, []int{0, 1, 2, 3, 0, 1}, ""},
		{"an entry whose key nobody freed keeps its own",
			plan(t, []float64{1, 1, -1, 1, -1, -1}, "2", 2, 6), []int{0, 1, 0, 1, 2, 2}, false, []int{0, 1, 2, 3, 4, 5}, ""},
		{"reuse resolves through earlier reuse: the fourth microbatch takes the first's entry",
			plan(t, []float64{1, -1, 1, -1, 1, -1, 1, -1}, "1", 1, 4), []int{0, 0, 0, 0}, false, []int{0, 0, 0, 0}, ""},
		{"two chunks: a chunk's backward frees that chunk's oldest microbatch, for any chunk with its key",
			plan(t, []float64{1, 2, -2, 1, 2, -1, -2, -1}, "1,1", 2, 4), []int{0, 0, 0, 0}, false, []int{0, 2, 2, 3}, ""},
		{"weight-gradient entries free nothing",
			plan(t, []float64{1, -1, -1.5, 1, -1, -1.5}, "1", 1, 2), []int{0, 0}, false, []int{0, 0}, ""},
		{"chain: a chunk's later layer takes its microbatch's first entry and frees nothing",
			plan(t, []float64{1, 1, -1, 1, -1, -1}, "2", 2, 6), []int{0, 0, 0, 0, 0, 0}, true, []int{0, 0, 2, 2, 0, 0}, ""},
		{"chain: a later layer of another key keeps its own entry and its place in the reuse",
			plan(t, []float64{1, 1, -1, 1, -1, -1}, "2", 2, 6), []int{0, 1, 0, 1, 0, 1}, true, []int{0, 1, 2, 3, 0, 1}, ""},
		{"keys for every pass", plan(t, []float64{1, -1}, "1", 1, 1), []int{}, false, nil, "0 sample keys for 1 passes"},
		{"the default schedule has no entries to reorganise", defaultPlan(t, 2, true), []int{0, 0}, false, nil, "only for an _order"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, chained, err := ReuseSampleEntries(tc.p, tc.keys, tc.chain)
			if tc.errMsg != "" {
				if err == nil || !strings.Contains(err.Error(), tc.errMsg) {
					t.Fatalf("err = %v, want one containing %q", err, tc.errMsg)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
			for pass, c := range chained {
				if c && (!tc.chain || got[pass] != got[pass-1]) {
					t.Errorf("pass %d marked chained (entry %d, previous layer's %d)", pass, got[pass], got[pass-1])
				}
			}
		})
	}
}

// FuzzReuseSampleEntries checks on random schedules what makes the
// reorganisation safe: an entry is taken only from a pass with the same key
// whose backward ran before the taking pass's forward, never from a pass
// still in flight, and entries resolve to passes that keep their own.
func FuzzReuseSampleEntries(f *testing.F) {
	f.Add(int64(1), 2, 3, 2, 1, false)
	f.Add(int64(7), 4, 8, 2, 2, true)
	f.Fuzz(func(t *testing.T, seed int64, chunks, micro, layers, nkeys int, chain bool) {
		chunks, micro, layers, nkeys = 1+absInt(chunks)%4, 1+absInt(micro)%8, 1+absInt(layers)%3, 1+absInt(nkeys)%3
		r := rand.New(rand.NewSource(seed))
		ord := randomOrder(r, chunks, micro, false, false)
		ls := make([]byte, 0, 2*chunks)
		for c := 0; c < chunks; c++ {
			if c > 0 {
				ls = append(ls, ',')
			}
			ls = append(ls, byte('0'+layers))
		}
		p := plan(t, ord, string(ls), chunks*layers, chunks*layers*micro)
		keys := make([]int, p.Passes)
		for i := range keys {
			keys[i] = r.Intn(nkeys)
		}
		got, marked, err := ReuseSampleEntries(p, keys, chain)
		if err != nil {
			t.Fatal(err)
		}
		at := stepsOf(p)
		for pass, e := range got {
			if e == pass {
				continue
			}
			if marked[pass] != (chain && pass%layers > 0 && keys[pass] == keys[pass-1]) {
				t.Fatalf("pass %d: chained %v", pass, marked[pass])
			}
			if marked[pass] {
				if e != got[pass-1] {
					t.Fatalf("chained pass %d takes entry %d, not its previous layer's %d", pass, e, got[pass-1])
				}
				continue
			}
			if got[e] != e || at.fwd(e) > at.fwd(pass) || keys[e] != keys[pass] {
				t.Fatalf("pass %d takes entry %d (which takes %d; keys %d, %d)", pass, e, got[e], keys[pass], keys[e])
			}
			// every pass sharing entry e is done with it before the next one's forward
			for q := range got {
				chained := chain && q%layers > 0 && keys[q] == keys[q-1]
				if q != pass && !chained && got[q] == e && at.fwd(q) < at.fwd(pass) && at.bwd(q) > at.fwd(pass) {
					t.Fatalf("pass %d takes entry %d while pass %d (forward step %d, backward %d) still reads it at step %d",
						pass, e, q, at.fwd(q), at.bwd(q), at.fwd(pass))
				}
			}
		}
	})
}

func absInt(x int) int { return max(x, -x) }
