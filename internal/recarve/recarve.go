// Package recarve checks the real invariant of CUDA graphs that share a
// memory pool (pytorch#166975): they may replay in any order as long as no
// graph reads memory that another graph's replay overwrote since the
// reader's producer wrote it, and no graph overwrites memory that still
// holds another graph's content a later replay will read. A capture can
// re-carve pool memory an earlier capture freed (a backward's transients
// in a forward's dead activations, a later layer's grad in a released
// buffer); replays in capture order are safe by construction, others are
// safe exactly when this checker finds no conflict.
//
// Per pool it keeps, for every byte range graphs write, which graph's
// replay wrote it last and which graphs still have to read that content.
// What each graph writes (every block its capture allocated in the pool)
// and reads (blocks another graph's capture produced: saved activations,
// chained buffers) is given by the executor, which learns it from the
// allocator during capture. The checker is policy only: no CUDA, no torch.
package recarve

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// Graph names one captured graph: a pass and its kind (0 forward,
// 1 backward, 2 weight gradient).
type Graph struct {
	Pass int64
	Kind int
}

// Range is the byte range [Start, End) of a pool.
type Range struct {
	Start, End uint64
}

func (r Range) String() string { return fmt.Sprintf("[%#x, %#x)", r.Start, r.End) }

func (r Range) overlaps(o Range) bool { return r.Start < o.End && o.Start < r.End }

// Read is content a graph reads that another graph's replay produced.
type Read struct {
	Range
	Producer Graph
	What     string // e.g. "saved activations of pass 3's forward"
}

// Handout is pool-planned memory a graph's replay hands to the caller: a
// returned output or input grad whose buffer went back to the pool once the
// schedule was done with it, so a later capture may have re-carved it.
type Handout struct {
	Range
	Index int    // which output (forward) or grad input (backward)
	What  string // e.g. "output 0"
}

// Spec is what one graph does to its pool at every replay.
type Spec struct {
	Name     string // e.g. `pass 3 ("Linear") backward`
	Writes   []Range
	Reads    []Read
	Handouts []Handout
}

// piece is a maximal range with one writer and one set of pending readers.
type piece struct {
	Range
	written bool
	writer  Graph
	pending map[Graph]bool
}

// Pool is the checker of one memory pool.
type Pool struct {
	specs  map[Graph]*Spec
	pieces []piece // sorted by Start, non-overlapping
	// readers indexes every spec's reads by producer (nil: rebuild on use),
	// so a replay's writes find their readers without scanning every spec.
	readers map[Graph][]readRef
}

// readRef is one graph's read of a producer's content.
type readRef struct {
	reader Graph
	Range
}

// readersOf returns the reads of g's product, by any known graph.
func (p *Pool) readersOf(g Graph) []readRef {
	if p.readers == nil {
		p.readers = map[Graph][]readRef{}
		for h, s := range p.specs {
			for _, r := range s.Reads {
				p.readers[r.Producer] = append(p.readers[r.Producer], readRef{h, r.Range})
			}
		}
	}
	return p.readers[g]
}

// at returns the index range [lo, hi) of the pieces overlapping r.
func (p *Pool) at(r Range) (lo, hi int) {
	lo = sort.Search(len(p.pieces), func(i int) bool { return p.pieces[i].End > r.Start })
	hi = lo
	for hi < len(p.pieces) && p.pieces[hi].Start < r.End {
		hi++
	}
	return lo, hi
}

// NewPool returns a pool that knows no graph.
func NewPool() *Pool { return &Pool{specs: map[Graph]*Spec{}} }

// Add records what g writes and reads at every replay.
func (p *Pool) Add(g Graph, s Spec) error {
	for _, r := range s.Writes {
		if r.Start >= r.End {
			return fmt.Errorf("recarve: %s writes the empty or inverted range %s", s.Name, r)
		}
	}
	for _, r := range s.Reads {
		if r.Start >= r.End {
			return fmt.Errorf("recarve: %s reads the empty or inverted range %s", s.Name, r.Range)
		}
		if r.Producer == g {
			return fmt.Errorf("recarve: %s reads %s as its own product: a graph's own writes are not reads", s.Name, r.Range)
		}
	}
	for _, h := range s.Handouts {
		if h.Start >= h.End || h.Index < 0 {
			return fmt.Errorf("recarve: %s hands out %s (index %d): want a non-empty range and an index >= 0", s.Name, h.Range, h.Index)
		}
	}
	cp := s
	p.specs[g] = &cp
	p.readers = nil
	return nil
}

// Clobber is a hand-out of another graph that a replay overwrites: the
// caller's tensor no longer holds what that graph returned.
type Clobber struct {
	Owner   Graph
	Index   int
	Message string // the error a read of the caller's tensor raises
}

// Clobbers lists, in a stable order, the other graphs' hand-outs that g's
// replay overwrites (its writes overlap them: its capture re-carved their
// memory). A graph's own hand-outs are not listed: that a replay rewrites
// what the previous replay of the same graph returned is the static-output
// contract.
func (p *Pool) Clobbers(g Graph) []Clobber {
	s := p.specs[g]
	if s == nil {
		return nil
	}
	var out []Clobber
	for _, h := range p.sorted() {
		if h == g {
			continue
		}
		for _, ho := range p.specs[h].Handouts {
			for _, w := range s.Writes {
				if !w.overlaps(ho.Range) {
					continue
				}
				out = append(out, Clobber{Owner: h, Index: ho.Index, Message: fmt.Sprintf(
					"gograph: this tensor is %s of %s, a pool-planned buffer, and %s's replay overwrote it (pool bytes %s: "+
						"a later capture re-carved that memory once the schedule was done with the buffer). Read or "+
						"clone a returned tensor before the graphs that follow in the schedule replay",
					ho.What, p.specs[h].Name, s.Name, clip(w, ho.Range))})
				break
			}
		}
	}
	return out
}

// sorted returns the known graphs by pass, then kind.
func (p *Pool) sorted() []Graph {
	gs := make([]Graph, 0, len(p.specs))
	for g := range p.specs {
		gs = append(gs, g)
	}
	sort.Slice(gs, func(i, j int) bool {
		if gs[i].Pass != gs[j].Pass {
			return gs[i].Pass < gs[j].Pass
		}
		return gs[i].Kind < gs[j].Kind
	})
	return gs
}

// Forget drops g (its pass was reset): it neither writes nor reads any
// more, and nothing waits for it.
func (p *Pool) Forget(g Graph) {
	delete(p.specs, g)
	p.readers = nil
	for i := range p.pieces {
		delete(p.pieces[i].pending, g)
	}
}

// ConflictError is a replay that would read overwritten memory or
// overwrite memory another graph still needs.
type ConflictError struct {
	Graph   string // the graph about to replay
	Range   Range
	Owner   string   // the graph whose content is there (overwrite), or that overwrote it (stale read)
	Needed  []string // graphs that still need it (overwrite)
	What    string   // what the reader expected (stale read)
	Missing bool     // a stale read of content its producer never wrote
}

func (e *ConflictError) Error() string {
	advice := "graphs sharing a pool may replay in any order only while none reads memory another overwrote " +
		"and none overwrites memory another still needs (pytorch#166975): replay them in the order they were " +
		"captured, or give them separate pools"
	switch {
	case e.Needed != nil:
		return fmt.Sprintf("gograph: %s is about to overwrite pool bytes %s, which hold the content %s wrote and %s "+
			"still needs; %s", e.Graph, e.Range, e.Owner, strings.Join(e.Needed, ", "), advice)
	case e.Missing:
		return fmt.Sprintf("gograph: %s is about to read %s (pool bytes %s), which no replay has written yet; %s",
			e.Graph, e.What, e.Range, advice)
	}
	return fmt.Sprintf("gograph: %s is about to read %s (pool bytes %s), but %s overwrote them since; %s",
		e.Graph, e.What, e.Range, e.Owner, advice)
}

// Knows reports whether g was added (and not forgotten).
func (p *Pool) Knows(g Graph) bool { return p.specs[g] != nil }

// Replay checks g's replay and, when it may run, records it: its reads are
// done, its writes now hold its content for the graphs that read it. A
// graph the pool does not know reads and writes nothing here.
func (p *Pool) Replay(g Graph) error {
	if err := p.Check(g); err != nil {
		return err
	}
	p.apply(g)
	return nil
}

// Check returns the conflict replaying g now would be, changing nothing.
func (p *Pool) Check(g Graph) error {
	s := p.specs[g]
	if s == nil {
		return nil
	}
	if err := p.checkReads(g, s); err != nil {
		return err
	}
	return p.checkWrites(g, s)
}

// Discard says that the later kinds of pass will not read what its earlier
// kinds wrote this time (a forward replayed where no backward can follow):
// nothing waits for them.
func (p *Pool) Discard(pass int64) {
	for i := range p.pieces {
		for r := range p.pieces[i].pending {
			if r.Pass == pass {
				delete(p.pieces[i].pending, r)
			}
		}
	}
}

// ForgetPass forgets every graph of pass (it was reset).
func (p *Pool) ForgetPass(pass int64) {
	for g := range p.specs {
		if g.Pass == pass {
			p.Forget(g)
		}
	}
}

func (p *Pool) apply(g Graph) {
	s := p.specs[g]
	if s == nil {
		return
	}
	for _, r := range s.Reads {
		lo, hi := p.at(r.Range)
		for i := lo; i < hi; i++ {
			delete(p.pieces[i].pending, g)
		}
	}
	for _, w := range s.Writes {
		p.write(g, w)
	}
}

func (p *Pool) checkReads(g Graph, s *Spec) error {
	for _, r := range s.Reads {
		covered := uint64(0)
		lo, hi := p.at(r.Range)
		for _, pc := range p.pieces[lo:hi] {
			covered += min(pc.End, r.End) - max(pc.Start, r.Start)
			if !pc.written || pc.writer != r.Producer {
				e := &ConflictError{Graph: s.Name, Range: clip(pc.Range, r.Range), What: r.What, Missing: !pc.written}
				e.Owner = p.name(pc.writer)
				return e
			}
		}
		if covered < r.End-r.Start {
			return &ConflictError{Graph: s.Name, Range: r.Range, What: r.What, Missing: true}
		}
	}
	return nil
}

func (p *Pool) checkWrites(g Graph, s *Spec) error {
	for _, w := range s.Writes {
		lo, hi := p.at(w)
		for _, pc := range p.pieces[lo:hi] {
			if !pc.written || pc.writer == g {
				continue
			}
			var needed []string
			for r := range pc.pending {
				if r != g {
					needed = append(needed, p.name(r))
				}
			}
			if len(needed) > 0 {
				sort.Strings(needed)
				return &ConflictError{Graph: s.Name, Range: clip(pc.Range, w), Owner: p.name(pc.writer), Needed: needed}
			}
		}
	}
	return nil
}

// write makes w hold g's content, awaited by every graph that reads g's
// product there.
func (p *Pool) write(g Graph, w Range) {
	p.split(w.Start)
	p.split(w.End)
	lo, hi := p.at(w) // after the splits, exactly the pieces inside w
	readers := p.readersOf(g)
	// The readers of g's product, cut at their bounds inside w.
	cuts := []uint64{w.Start, w.End}
	for _, r := range readers {
		if r.overlaps(w) {
			cuts = append(cuts, max(r.Start, w.Start), min(r.End, w.End))
		}
	}
	sort.Slice(cuts, func(i, j int) bool { return cuts[i] < cuts[j] })
	var fresh []piece
	for i := 0; i+1 < len(cuts); i++ {
		if cuts[i] == cuts[i+1] {
			continue
		}
		pc := piece{Range: Range{cuts[i], cuts[i+1]}, written: true, writer: g, pending: map[Graph]bool{}}
		for _, r := range readers {
			if r.overlaps(pc.Range) {
				pc.pending[r.reader] = true
			}
		}
		fresh = append(fresh, pc)
	}
	p.pieces = append(p.pieces[:lo:lo], append(fresh, p.pieces[hi:]...)...)
}

// split cuts the piece containing at into two at at.
func (p *Pool) split(at uint64) {
	for i, pc := range p.pieces {
		if pc.Start < at && at < pc.End {
			left, right := pc, pc
			left.End, right.Start = at, at
			right.pending = make(map[Graph]bool, len(pc.pending))
			for k := range pc.pending {
				right.pending[k] = true
			}
			p.pieces = append(p.pieces[:i], append([]piece{left, right}, p.pieces[i+1:]...)...)
			return
		}
	}
}

func (p *Pool) name(g Graph) string {
	if s := p.specs[g]; s != nil {
		return s.Name
	}
	return fmt.Sprintf("pass %d (kind %d, reset)", g.Pass, g.Kind)
}

func clip(a, b Range) Range { return Range{max(a.Start, b.Start), min(a.End, b.End)} }

// ParseSpec parses a graph's spec as the executor sends it, one item per
// line (numbers in decimal):
//
//	name TEXT...                       how errors name the graph
//	w START END                        it writes [START, END)
//	r START END PASS KIND TEXT...      it reads [START, END), which PASS's KIND graph wrote (TEXT: what)
//	h START END INDEX TEXT...          it hands the caller pool-planned [START, END) as INDEX (TEXT: what)
func ParseSpec(text string) (Spec, error) {
	var s Spec
	for n, line := range strings.Split(strings.TrimSpace(text), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		bad := func() (Spec, error) {
			return Spec{}, fmt.Errorf(`recarve: spec line %d (%q): want "name TEXT", "w START END", "r START END PASS KIND TEXT" or "h START END INDEX TEXT"`, n+1, line)
		}
		switch {
		case f[0] == "name":
			s.Name = strings.Join(f[1:], " ")
		case f[0] == "w" && len(f) == 3:
			a, err1 := strconv.ParseUint(f[1], 10, 64)
			b, err2 := strconv.ParseUint(f[2], 10, 64)
			if err1 != nil || err2 != nil {
				return bad()
			}
			s.Writes = append(s.Writes, Range{a, b})
		case f[0] == "r" && len(f) >= 5:
			a, err1 := strconv.ParseUint(f[1], 10, 64)
			b, err2 := strconv.ParseUint(f[2], 10, 64)
			pass, err3 := strconv.ParseInt(f[3], 10, 64)
			kind, err4 := strconv.Atoi(f[4])
			if err1 != nil || err2 != nil || err3 != nil || err4 != nil || kind < 0 || kind > 2 {
				return bad()
			}
			s.Reads = append(s.Reads, Read{Range{a, b}, Graph{pass, kind}, strings.Join(f[5:], " ")})
		case f[0] == "h" && len(f) >= 4:
			a, err1 := strconv.ParseUint(f[1], 10, 64)
			b, err2 := strconv.ParseUint(f[2], 10, 64)
			index, err3 := strconv.Atoi(f[3])
			if err1 != nil || err2 != nil || err3 != nil {
				return bad()
			}
			s.Handouts = append(s.Handouts, Handout{Range{a, b}, index, strings.Join(f[4:], " ")})
		default:
			return bad()
		}
	}
	return s, nil
}
