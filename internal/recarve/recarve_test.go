package recarve

import (
	"errors"
	"strings"
	"testing"
)

var (
	f0 = Graph{0, 0}
	f1 = Graph{1, 0}
	b0 = Graph{0, 1}
	b1 = Graph{1, 1}
)

// chain is two layers captured F0 F1 B1 B0 in one pool: B0's capture
// re-carved the activations F1 left (dead once B1 was captured) for its
// transients, and reads the input grad B1 wrote (a chained grad output).
func chain(t *testing.T) *Pool {
	t.Helper()
	p := NewPool()
	add := func(g Graph, s Spec) {
		if err := p.Add(g, s); err != nil {
			t.Fatal(err)
		}
	}
	add(f0, Spec{Name: "pass 0 forward", Writes: []Range{{0, 100}}})
	add(f1, Spec{Name: "pass 1 forward", Writes: []Range{{100, 200}}})
	add(b1, Spec{Name: "pass 1 backward", Writes: []Range{{200, 350}},
		Reads: []Read{{Range{100, 200}, f1, "saved activations of pass 1's forward"}}})
	add(b0, Spec{Name: "pass 0 backward", Writes: []Range{{100, 150}, {400, 450}},
		Reads: []Read{{Range{0, 100}, f0, "saved activations of pass 0's forward"}, {Range{300, 350}, b1, "pass 1's input grad"}}})
	return p
}

func replay(p *Pool, gs ...Graph) error {
	for _, g := range gs {
		if err := p.Replay(g); err != nil {
			return err
		}
	}
	return nil
}

func TestReplayOrders(t *testing.T) {
	cases := []struct {
		name  string
		order []Graph
		want  string // "" for none
	}{
		{"capture order, two steps", []Graph{f0, f1, b1, b0, f0, f1, b1, b0}, ""},
		{"forwards only, twice (inference with training graphs)", []Graph{f0, f1, f0, f1}, ""},
		{"a backward before the one whose grad it reads", []Graph{f0, f1, b0},
			"pass 0 backward is about to read pass 1's input grad (pool bytes [0x12c, 0x15e)), which no replay has written yet"},
		{"a backward over memory a pending backward still needs", []Graph{f0, f1, b1, f1, b0},
			"pass 0 backward is about to overwrite pool bytes [0x64, 0x96), which hold the content pass 1 forward wrote and pass 1 backward still needs"},
		{"a backward of the next step skipped", []Graph{f0, f1, b1, b0, f0, f1, b0},
			"pass 0 backward is about to overwrite pool bytes [0x64, 0x96), which hold the content pass 1 forward wrote and pass 1 backward still needs"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := replay(chain(t), c.order...)
			if c.want == "" {
				if err != nil {
					t.Fatalf("unexpected %v", err)
				}
				return
			}
			var ce *ConflictError
			if !errors.As(err, &ce) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v\nwant %q", err, c.want)
			}
			if !strings.Contains(err.Error(), "pytorch#166975") {
				t.Errorf("the error says what to do: %v", err)
			}
		})
	}
}

// TestStaleReadAfterOverwrite: sglang#37606's shape. Graph A's output is
// read later by graph C; graph B's capture re-carved A's output once the
// executor thought it dead. B after A and before C is caught at B (C still
// needs it); a C registered late that reads after B is a stale read.
func TestStaleReadAfterOverwrite(t *testing.T) {
	a, b, c := Graph{10, 0}, Graph{11, 0}, Graph{12, 0}
	p := NewPool()
	_ = p.Add(a, Spec{Name: "A", Writes: []Range{{0, 64}}})
	_ = p.Add(b, Spec{Name: "B", Writes: []Range{{0, 64}}})
	_ = p.Add(c, Spec{Name: "C", Reads: []Read{{Range{0, 64}, a, "A's output"}}})
	if err := replay(p, a, c, b, a, c); err != nil {
		t.Fatalf("A, C, B, A, C is legitimate: %v", err)
	}
	if err := replay(p, b); err != nil {
		t.Fatalf("B over A's content nobody needs any more: %v", err)
	}
	err := replay(p, a, b)
	if err == nil || !strings.Contains(err.Error(), "B is about to overwrite pool bytes [0x0, 0x40), which hold the content A wrote and C still needs") {
		t.Fatalf("got %v", err)
	}
	p.Forget(c) // C's pass was reset: nothing waits for A's output
	if err := replay(p, b); err != nil {
		t.Fatalf("after C was forgotten: %v", err)
	}
	_ = p.Add(c, Spec{Name: "C", Reads: []Read{{Range{0, 64}, a, "A's output"}}})
	if err := replay(p, c); err == nil || !strings.Contains(err.Error(), "C is about to read A's output (pool bytes [0x0, 0x40)), but B overwrote them since") {
		t.Fatalf("got %v", err)
	}
}

// TestIndependentGraphsReplayInAnyOrder: two microbatches' passes in one
// pool whose memory does not overlap replay in every order.
func TestIndependentGraphsReplayInAnyOrder(t *testing.T) {
	p := NewPool()
	m0f, m0b, m1f, m1b := Graph{0, 0}, Graph{0, 1}, Graph{1, 0}, Graph{1, 1}
	_ = p.Add(m0f, Spec{Name: "m0 forward", Writes: []Range{{0, 10}}})
	_ = p.Add(m1f, Spec{Name: "m1 forward", Writes: []Range{{10, 20}}})
	_ = p.Add(m0b, Spec{Name: "m0 backward", Writes: []Range{{20, 30}}, Reads: []Read{{Range{0, 10}, m0f, "m0"}}})
	_ = p.Add(m1b, Spec{Name: "m1 backward", Writes: []Range{{30, 40}}, Reads: []Read{{Range{10, 20}, m1f, "m1"}}})
	for _, order := range [][]Graph{{m0f, m1f, m0b, m1b}, {m0f, m1f, m1b, m0b}, {m1f, m0f, m0b, m1b}, {m1f, m1b, m0f, m0b}} {
		if err := replay(p, order...); err != nil {
			t.Errorf("%v: %v", order, err)
		}
	}
	if err := replay(p, Graph{99, 0}); err != nil {
		t.Errorf("an unknown graph reads and writes nothing: %v", err)
	}
}

func TestAddRefusesBadSpecs(t *testing.T) {
	p := NewPool()
	for _, s := range []Spec{
		{Name: "x", Writes: []Range{{5, 5}}},
		{Name: "x", Reads: []Read{{Range{9, 3}, f1, "y"}}},
		{Name: "x", Reads: []Read{{Range{0, 3}, f0, "itself"}}},
	} {
		if err := p.Add(f0, s); err == nil {
			t.Errorf("%+v accepted", s)
		}
	}
}

func FuzzReplay(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 0, 1, 3, 2})
	f.Fuzz(func(t *testing.T, data []byte) {
		p := NewPool()
		gs := []Graph{{0, 0}, {1, 0}, {0, 1}, {1, 1}}
		for i, g := range gs {
			var s Spec
			s.Name = "g"
			if len(data) > i {
				lo := uint64(data[i] % 8 * 16)
				s.Writes = []Range{{lo, lo + 24}}
			}
			if len(data) > i+4 && g.Kind == 1 {
				lo := uint64(data[i+4] % 8 * 16)
				s.Reads = []Read{{Range{lo, lo + 20}, gs[i-2], "its forward"}}
			}
			if len(data) > i+8 {
				lo := uint64(data[i+8] % 8 * 16)
				s.Handouts = []Handout{{Range{lo, lo + 8}, i, "output"}}
			}
			if err := p.Add(g, s); err != nil {
				t.Fatal(err)
			}
		}
		for _, d := range data {
			g := gs[int(d)%len(gs)]
			for _, c := range p.Clobbers(g) {
				if c.Owner == g || !overlapsAny(p.specs[g].Writes, p.specs[c.Owner].Handouts[0].Range) {
					t.Fatalf("%v clobbers %+v without overwriting it", g, c)
				}
			}
			err := p.Replay(g)
			for i := 1; i < len(p.pieces); i++ {
				if p.pieces[i-1].End > p.pieces[i].Start || p.pieces[i].Start >= p.pieces[i].End {
					t.Fatalf("pieces overlap or are empty: %+v", p.pieces)
				}
			}
			if err == nil {
				for _, w := range p.specs[g].Writes {
					for _, pc := range p.pieces {
						if pc.overlaps(w) && pc.writer != g {
							t.Fatalf("after %v replayed, %s is %v's", g, pc.Range, pc.writer)
						}
					}
				}
			}
		}
	})
}

func overlapsAny(ws []Range, r Range) bool {
	for _, w := range ws {
		if w.overlaps(r) {
			return true
		}
	}
	return false
}

func TestParseSpec(t *testing.T) {
	s, err := ParseSpec("name pass 3 (\"Linear\") backward\nw 4096 8192\nr 0 4096 3 0 saved activations of its forward\n")
	if err != nil {
		t.Fatal(err)
	}
	if s.Name != `pass 3 ("Linear") backward` || len(s.Writes) != 1 || s.Writes[0] != (Range{4096, 8192}) ||
		len(s.Reads) != 1 || s.Reads[0].Producer != (Graph{3, 0}) || s.Reads[0].What != "saved activations of its forward" {
		t.Errorf("%+v", s)
	}
	for _, bad := range []string{"w 1", "w a b", "r 0 1 2", "r 0 1 2 7 x", "q"} {
		if _, err := ParseSpec(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// TestDiscard: a forward replayed where its backward cannot follow (under
// no_grad) leaves nothing pending, so other graphs may reuse its memory.
func TestDiscard(t *testing.T) {
	p := chain(t)
	if err := replay(p, f0, f1); err != nil {
		t.Fatal(err)
	}
	if err := p.Check(b0); err == nil {
		t.Fatal("B0 over F1's pending content must conflict")
	}
	p.Discard(1)
	p.Discard(0)
	if !p.Knows(b0) || p.Check(b0) == nil {
		t.Fatal("B0 still reads pass 1's input grad, which no replay wrote")
	}
	p.ForgetPass(1)
	if p.Knows(b1) || p.Knows(f1) {
		t.Fatal("ForgetPass keeps pass 1's graphs")
	}
}

// TestClobbers: pass 0's forward hands out a pool-planned output at
// [0, 40); pass 1's backward was captured after that buffer went back to
// the pool and re-carved part of it.
func TestClobbers(t *testing.T) {
	p := NewPool()
	must := func(g Graph, s Spec) {
		t.Helper()
		if err := p.Add(g, s); err != nil {
			t.Fatal(err)
		}
	}
	must(f0, Spec{Name: "pass 0 forward", Writes: []Range{{0, 100}}, Handouts: []Handout{{Range{0, 40}, 0, "output 0"}}})
	must(b0, Spec{Name: "pass 0 backward", Writes: []Range{{100, 200}}, Handouts: []Handout{{Range{100, 120}, 1, "grad input 1"}}})
	must(f1, Spec{Name: "pass 1 forward", Writes: []Range{{300, 400}}})
	must(b1, Spec{Name: "pass 1 backward", Writes: []Range{{30, 60}, {110, 115}}})
	cases := []struct {
		g    Graph
		want []string // owner/index: message fragments
	}{
		{f0, nil}, // its own hand-out: the static-output contract
		{b0, nil},
		{f1, nil}, // disjoint
		{b1, []string{
			"this tensor is output 0 of pass 0 forward, a pool-planned buffer, and pass 1 backward's replay overwrote it (pool bytes [0x1e, 0x28)",
			"this tensor is grad input 1 of pass 0 backward, a pool-planned buffer, and pass 1 backward's replay overwrote it (pool bytes [0x6e, 0x73)",
		}},
		{Graph{9, 0}, nil}, // unknown
	}
	for _, c := range cases {
		got := p.Clobbers(c.g)
		if len(got) != len(c.want) {
			t.Fatalf("%v: %d clobbers %+v, want %d", c.g, len(got), got, len(c.want))
		}
		for i, w := range c.want {
			if !strings.Contains(got[i].Message, w) {
				t.Errorf("%v clobber %d: %q lacks %q", c.g, i, got[i].Message, w)
			}
		}
	}
	if got := p.Clobbers(b1); got[0].Owner != f0 || got[0].Index != 0 || got[1].Owner != b0 || got[1].Index != 1 {
		t.Errorf("owners %+v", got)
	}
	p.ForgetPass(0)
	if got := p.Clobbers(b1); len(got) != 0 {
		t.Errorf("after pass 0 was reset: %+v", got)
	}
}

func TestParseHandouts(t *testing.T) {
	s, err := ParseSpec("name g\nh 0 64 2 grad input 2\n")
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Handouts) != 1 || s.Handouts[0] != (Handout{Range{0, 64}, 2, "grad input 2"}) {
		t.Errorf("%+v", s.Handouts)
	}
	for _, bad := range []string{"h 0 64", "h 0 64 x y", "h a 64 0 y"} {
		if _, err := ParseSpec(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
	if err := NewPool().Add(f0, Spec{Name: "x", Handouts: []Handout{{Range{4, 4}, 0, "o"}}}); err == nil {
		t.Error("an empty hand-out accepted")
	}
}
