package poolmodel

import (
	"strings"
	"testing"
)

const MiB = 1 << 20

func TestPlacesAsTheCachingAllocator(t *testing.T) {
	tests := []struct {
		name   string
		events string
		want   string // the placements, relative to the first allocation's start
	}{
		{"a freed block is given to the next request that fits",
			"a 1 4096 g\nf 1\na 2 1024 g", "1 0 4096\n2 0 1024\n"},
		{"blocks of one segment follow each other",
			"a 1 4096 g\na 2 4096 g", "1 0 4096\n2 4096 8192\n"},
		{"rounding to 512 bytes", "a 1 100 g", "1 0 512\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := New()
			got, err := m.Apply(tc.events)
			if err != nil {
				t.Fatal(err)
			}
			if rel := relative(t, got); rel != tc.want {
				t.Errorf("got\n%swant\n%s", rel, tc.want)
			}
		})
	}
}

// relative renders placements with addresses counted from the first one's start.
func relative(t *testing.T, text string) string {
	t.Helper()
	var b strings.Builder
	var base uint64
	for i, line := range strings.Split(strings.TrimSpace(text), "\n") {
		var id int
		var s, e uint64
		if _, err := sscan(line, &id, &s, &e); err != nil {
			t.Fatalf("placement %q: %v", line, err)
		}
		if i == 0 {
			base = s
		}
		b.WriteString(strings.Join([]string{itoa(id), utoa(s - base), utoa(e - base)}, " ") + "\n")
	}
	return b.String()
}

func TestPoolsAndStreamsNeverShareMemory(t *testing.T) {
	m := New()
	a, _ := m.Alloc(1, 4096, "g")
	if err := m.Free(1); err != nil {
		t.Fatal(err)
	}
	b, _ := m.Alloc(2, 4096, "g/out") // another stream's blocks: a segment of its own
	if b.Start < a.End && a.Start < b.End {
		t.Fatalf("pool g/out's block %v overlaps pool g's freed %v", b, a)
	}
	free := m.FreeRanges("g")
	if len(free) != 1 || free[0].Start != a.Start || free[0].End-free[0].Start != 2*MiB || !free[0].Small {
		t.Fatalf("g's free memory %v, want its whole 2 MiB segment from %#x", free, a.Start)
	}
	if m.FreeRanges("unknown") != nil {
		t.Fatal("a pool nothing named has no free memory")
	}
}

func TestLargeRequestsTakeLargeSegments(t *testing.T) {
	m := New()
	r, err := m.Alloc(1, 8*MiB, "g")
	if err != nil {
		t.Fatal(err)
	}
	free := m.FreeRanges("g")
	if len(free) != 1 || free[0].Start != r.End || free[0].End-free[0].Start != 12*MiB || free[0].Small {
		t.Fatalf("an 8 MiB request leaves %v free, want the 12 MiB rest of a 20 MiB segment", free)
	}
}

func TestBadEvents(t *testing.T) {
	for _, ev := range []string{"a 1 -4 g", "a x 4 g", "f 9", "z", "a 1 4 g\na 1 4 g"} {
		if _, err := New().Apply(ev); err == nil {
			t.Errorf("%q accepted", ev)
		}
	}
}

func TestStore(t *testing.T) {
	s := NewStore()
	h := s.New()
	if err := s.With(h, func(m *Model) error { _, err := m.Alloc(1, 8, "g"); return err }); err != nil {
		t.Fatal(err)
	}
	if s.Live() != 1 || !s.Drop(h) || s.Drop(h) || s.Live() != 0 {
		t.Fatal("a model is held until dropped, once")
	}
	if err := s.With(h, func(*Model) error { return nil }); err == nil {
		t.Fatal("a dropped model is gone")
	}
}

// FuzzApply: arbitrary event text never panics, and accepted allocations
// never overlap a live one.
func FuzzApply(f *testing.F) {
	f.Add("a 1 4096 g\nf 1\na 2 1024 g\na 3 3000000 h\nf 2")
	f.Fuzz(func(t *testing.T, events string) {
		m := New()
		out, err := m.Apply(events)
		if err != nil {
			return
		}
		live := map[int]Range{}
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			if line == "" {
				continue
			}
			var id int
			var s, e uint64
			if _, err := sscan(line, &id, &s, &e); err != nil {
				t.Fatal(err)
			}
			live[id] = Range{s, e}
		}
		for id := range live {
			if _, ok := m.where[id]; !ok {
				delete(live, id)
			}
		}
		for a, ra := range live {
			for b, rb := range live {
				if a < b && ra.Start < rb.End && rb.Start < ra.End {
					t.Fatalf("live %d %v and %d %v overlap", a, ra, b, rb)
				}
			}
		}
	})
}

func sscan(line string, id *int, s, e *uint64) (int, error) {
	f := strings.Fields(line)
	if len(f) != 3 {
		return 0, errBadLine
	}
	var err error
	if *id, err = atoi(f[0]); err != nil {
		return 0, err
	}
	if *s, err = atou(f[1]); err != nil {
		return 0, err
	}
	*e, err = atou(f[2])
	return 3, err
}
