package allocsim

import (
	"testing"
)

const MiB = 1 << 20

type op struct {
	free bool
	id   int
	n    int64
}

func a(id int, n int64) op { return op{id: id, n: n} }
func f(id int) op          { return op{free: true, id: id} }

// apply runs ops on p, checking the pool's invariants after each.
func apply(t *testing.T, p *Pool, ops []op) {
	t.Helper()
	for _, o := range ops {
		var err error
		if o.free {
			err = p.Free(o.id)
		} else {
			err = p.Alloc(o.id, o.n)
		}
		if err != nil {
			t.Fatal(err)
		}
		checkInvariants(t, p)
	}
}

func TestPool(t *testing.T) {
	cases := []struct {
		name                        string
		ops                         []op
		reserved, allocated, peakRs int64
		segments                    int64
	}{
		{"one large request gets its own rounded segment", []op{a(1, 64*MiB+1)}, 66 * MiB, 64*MiB + 512, 66 * MiB, 1},
		{"a mid-size request gets a 20 MiB segment; the next fits its split tail", []op{a(1, 5*MiB), a(2, 5*MiB)}, 20 * MiB, 10 * MiB, 20 * MiB, 1},
		{"small requests share a 2 MiB segment", []op{a(1, 1000), a(2, 1000), a(3, SmallSize)}, 2 * MiB, 1024 + 1024 + MiB, 2 * MiB, 1},
		{"small and large pools do not share", []op{a(1, 1000), f(1), a(2, 12*MiB)}, 14 * MiB, 12 * MiB, 14 * MiB, 2},
		{"a freed block serves a smaller request, split", []op{a(1, 64*MiB), f(1), a(2, 32*MiB), a(3, 32*MiB)}, 64 * MiB, 64 * MiB, 64 * MiB, 1},
		{"no split when the rest is 1 MiB or less", []op{a(1, 64*MiB), f(1), a(2, 63*MiB), a(3, MiB)}, 66 * MiB, 65 * MiB, 66 * MiB, 2},
		{"freed neighbours merge", []op{a(1, 64*MiB), f(1), a(2, 16*MiB), a(3, 16*MiB), f(2), f(3), a(4, 64*MiB)}, 64 * MiB, 64 * MiB, 64 * MiB, 1},
		{"unmerged holes cannot serve a larger request", []op{a(1, 64*MiB), f(1), a(2, 16*MiB), a(3, 16*MiB), a(4, 16*MiB), f(2), f(4), a(5, 40*MiB)}, 104 * MiB, 56 * MiB, 104 * MiB, 2},
		{"peak reserved stays", []op{a(1, 10*MiB), a(2, 10*MiB), f(1), f(2)}, 20 * MiB, 0, 20 * MiB, 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := New()
			apply(t, p, c.ops)
			if p.Reserved() != c.reserved || p.Allocated() != c.allocated || p.PeakReserved() != c.peakRs || p.Segments() != c.segments {
				t.Errorf("reserved %d allocated %d peak %d segments %d; want %d %d %d %d",
					p.Reserved()/MiB, p.Allocated(), p.PeakReserved()/MiB, p.Segments(), c.reserved/MiB, c.allocated, c.peakRs/MiB, c.segments)
			}
		})
	}
}

func TestBestFit(t *testing.T) {
	p := New()
	// Holes of 40 and 30 MiB, separated by live blocks.
	for i, n := range []int64{40, 8, 30, 8} {
		if err := p.Alloc(i, n*MiB); err != nil {
			t.Fatal(err)
		}
	}
	_ = p.Free(0)
	_ = p.Free(2)
	if err := p.Alloc(9, 25*MiB); err != nil {
		t.Fatal(err)
	}
	if got := p.live[9].seg; got != 2 {
		t.Errorf("a 25 MiB request took segment %d, want the 30 MiB hole (segment 2)", got)
	}
}

func TestErrors(t *testing.T) {
	p := New()
	if err := p.Free(1); err == nil {
		t.Error("freeing an unknown allocation is an error")
	}
	if err := p.Alloc(1, -1); err == nil {
		t.Error("a negative size is an error")
	}
	_ = p.Alloc(1, 10)
	if err := p.Alloc(1, 10); err == nil {
		t.Error("a live id twice is an error")
	}
	if !p.Live(1) || p.Size(1) != 512 || p.Size(2) != 0 {
		t.Error("Live/Size")
	}
}

// checkInvariants: every segment's blocks tile it, no two free neighbours,
// the free lists hold exactly the free blocks in order, and the counters
// agree with the blocks.
func checkInvariants(t *testing.T, p *Pool) {
	t.Helper()
	var allocated int64
	heads := map[int64]*block{}
	for _, b := range p.live {
		allocated += b.size
		heads[b.seg] = head(b)
	}
	for _, list := range [][]*block{p.freeSmall, p.freeLarge} {
		for i, b := range list {
			if !b.free {
				t.Fatalf("a live block on a free list")
			}
			if i > 0 && !list[i-1].less(b) {
				t.Fatalf("free list out of order")
			}
			heads[b.seg] = head(b)
		}
	}
	if allocated != p.allocated || p.allocated > p.reserved || p.reserved > p.peakReserved || p.allocated > p.peakAllocated {
		t.Fatalf("counters: allocated %d (blocks %d) reserved %d peaks %d %d", p.allocated, allocated, p.reserved, p.peakReserved, p.peakAllocated)
	}
	var reserved int64
	for _, h := range heads {
		var off int64
		for b := h; b != nil; b = b.next {
			if b.offset != off {
				t.Fatalf("segment %d: block at %d, want %d", b.seg, b.offset, off)
			}
			if b.free && b.next != nil && b.next.free {
				t.Fatalf("segment %d: two free neighbours", b.seg)
			}
			off += b.size
		}
		reserved += off
	}
	if int64(len(heads)) != p.segments-p.released || reserved != p.reserved {
		t.Fatalf("segments %d of %d, reserved %d of %d", len(heads), p.segments, reserved, p.reserved)
	}
}

func head(b *block) *block {
	for b.prev != nil {
		b = b.prev
	}
	return b
}

func FuzzPool(f *testing.F) {
	f.Add([]byte{1, 200, 2, 3, 130, 1, 4})
	f.Fuzz(func(t *testing.T, data []byte) {
		p := New()
		next := 0
		var live []int
		for i := 0; i+1 < len(data); i += 2 {
			if data[i] == 0xff { // torch.cuda.empty_cache()
				p.ReleaseCached()
			} else if data[i]&1 == 1 && len(live) > 0 {
				k := int(data[i+1]) % len(live)
				if err := p.Free(live[k]); err != nil {
					t.Fatal(err)
				}
				live = append(live[:k], live[k+1:]...)
			} else {
				// sizes from 1 B to ~96 MiB, all three segment classes
				n := int64(data[i+1]) * int64(data[i]|1) * 3000
				if err := p.Alloc(next, n); err != nil {
					t.Fatal(err)
				}
				live = append(live, next)
				next++
			}
			checkInvariants(t, p)
		}
	})
}

func TestSeedLetsFreedNeighboursMerge(t *testing.T) {
	const mib = 1 << 20
	run := func(seed int64) *Pool {
		p := New()
		if seed > 0 {
			if err := p.Seed(seed); err != nil {
				t.Fatal(err)
			}
		}
		for id, n := range []int64{30 * mib, 30 * mib} {
			if err := p.Alloc(id, n); err != nil {
				t.Fatal(err)
			}
		}
		for id := range 2 {
			if err := p.Free(id); err != nil {
				t.Fatal(err)
			}
		}
		if err := p.Alloc(2, 50*mib); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cases := []struct {
		name               string
		seed               int64
		reserved, segments int64
	}{
		{"two 30 MiB segments cannot merge: a third for 50", 0, 110 * mib, 3},
		{"one 60 MiB seed: the freed halves merge and hold 50", 60 * mib, 60 * mib, 1},
		{"a 40 MiB seed: the second 30 needs a segment of its own", 40 * mib, 120 * mib, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := run(c.seed)
			if p.Reserved() != c.reserved || p.Segments() != c.segments {
				t.Errorf("reserved %d MiB in %d segments, want %d in %d", p.Reserved()/mib, p.Segments(), c.reserved/mib, c.segments)
			}
			if p.PeakAllocated() != 60*mib {
				t.Errorf("peak allocated %d MiB, want 60 (the seed is not counted)", p.PeakAllocated()/mib)
			}
		})
	}
}

func TestReleaseCachedGivesBackWholeFreeSegmentsOnly(t *testing.T) {
	p := New()
	apply(t, p, []op{a(1, 64*MiB), a(2, 12*MiB), a(3, 1000), a(4, 5*MiB), a(5, 5*MiB), f(1), f(3), f(4)})
	// segments: 64 MiB (free), 12 MiB (live), 2 MiB small (free), 20 MiB (half live)
	if got, want := p.Reserved(), int64(98*MiB); got != want {
		t.Fatalf("reserved %d, want %d", got, want)
	}
	p.ReleaseCached()
	if got, want := p.Reserved(), int64(32*MiB); got != want {
		t.Fatalf("after ReleaseCached reserved %d, want %d (the 12 MiB and 20 MiB segments)", got, want)
	}
	if got := p.PeakReserved(); got != 98*MiB {
		t.Fatalf("peak reserved %d, want it kept", got)
	}
	if err := p.Alloc(6, 64*MiB); err != nil { // a new segment: the free one is gone
		t.Fatal(err)
	}
	if got, want := p.Reserved(), int64(96*MiB); got != want {
		t.Fatalf("reserved %d, want %d", got, want)
	}
}
