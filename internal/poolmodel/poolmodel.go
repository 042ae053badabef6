// Package poolmodel keeps a running model of the CUDA caching allocator's
// graph pools for an engine that has none: the eager engine, on the CPU,
// with its pool model on. The engine reports each allocation and free its
// captures make, as they happen, and learns where CUDA's allocator would
// have placed each block (internal/allocsim), and which memory of a pool is
// free now. That is what lets the CPU run see what only the pool does on
// CUDA: a block that one graph writes being another graph's output or
// saved tensor (the engine then overwrites what such a replay would).
//
// Pools are named by the engine (a graph pool's key, or a key of its own
// for blocks of another stream: their free blocks serve that stream alone).
// Addresses are model addresses: a pool's segment s starts at
// (pool index + 1) << 52 | s << 36, so ranges of different segments or
// pools never meet, as different cudaMalloc results do not.
package poolmodel

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/gograph/gograph/internal/allocsim"
)

// Range is [Start, End) in model addresses.
type Range struct{ Start, End uint64 }

// Free is a free block: its range, and whether it is in the small pool
// (requests above allocsim.SmallSize never take it, whatever its size).
type Free struct {
	Range
	Small bool
}

// Model is the allocator state of every pool one engine reported.
type Model struct {
	pools map[string]*allocsim.Pool
	index map[string]uint64 // pool -> its address space
	where map[int]string    // live allocation -> its pool
}

// New returns a model with no pool.
func New() *Model {
	return &Model{pools: map[string]*allocsim.Pool{}, index: map[string]uint64{}, where: map[int]string{}}
}

func (m *Model) pool(name string) *allocsim.Pool {
	p, ok := m.pools[name]
	if !ok {
		p = allocsim.New()
		m.pools[name] = p
		m.index[name] = uint64(len(m.index))
	}
	return p
}

func (m *Model) address(pool string, seg, offset int64) uint64 {
	return (m.index[pool]+1)<<52 | uint64(seg)<<36 | uint64(offset)
}

// Alloc places allocation id of n bytes in pool and returns its range.
func (m *Model) Alloc(id int, n int64, pool string) (Range, error) {
	if _, ok := m.where[id]; ok {
		return Range{}, fmt.Errorf("allocation %d is already live", id)
	}
	p := m.pool(pool)
	if err := p.Alloc(id, n); err != nil {
		return Range{}, err
	}
	m.where[id] = pool
	seg, off, _ := p.Where(id)
	start := m.address(pool, seg, off)
	return Range{start, start + uint64(p.Size(id))}, nil
}

// Free returns allocation id to its pool.
func (m *Model) Free(id int) error {
	pool, ok := m.where[id]
	if !ok {
		return fmt.Errorf("free of allocation %d, which is not live", id)
	}
	delete(m.where, id)
	return m.pools[pool].Free(id)
}

// FreeRanges is the free memory of pool now, sorted (none for a pool no
// allocation named yet).
func (m *Model) FreeRanges(pool string) []Free {
	p, ok := m.pools[pool]
	if !ok {
		return nil
	}
	var out []Free
	for _, f := range p.FreeRanges() {
		start := m.address(pool, f.Seg, f.Offset)
		out = append(out, Free{Range{start, start + uint64(f.Size)}, f.Small})
	}
	sort.Slice(out, func(a, b int) bool { return out[a].Start < out[b].Start })
	return out
}

// Apply runs events, one per line: "a ID BYTES POOL" (an allocation),
// "f ID" (a free). It returns "ID START END" for each allocation, in order.
func (m *Model) Apply(events string) (string, error) {
	var b strings.Builder
	for n, line := range strings.Split(events, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if err := m.apply(f, &b); err != nil {
			return "", fmt.Errorf("poolmodel: line %d %q: %w", n+1, line, err)
		}
	}
	return b.String(), nil
}

func (m *Model) apply(f []string, b *strings.Builder) error {
	switch {
	case f[0] == "a" && len(f) == 4:
		id, err1 := strconv.Atoi(f[1])
		n, err2 := strconv.ParseInt(f[2], 10, 64)
		if err1 != nil || err2 != nil || id < 0 || n < 0 {
			return fmt.Errorf("want a ID BYTES POOL with a non-negative id and size")
		}
		r, err := m.Alloc(id, n, f[3])
		if err != nil {
			return err
		}
		fmt.Fprintf(b, "%d %d %d\n", id, r.Start, r.End)
	case f[0] == "f" && len(f) == 2:
		id, err := strconv.Atoi(f[1])
		if err != nil {
			return fmt.Errorf("want f ID")
		}
		return m.Free(id)
	default:
		return fmt.Errorf("unknown event (a ID BYTES POOL, f ID)")
	}
	return nil
}

// Store holds models by handle (from 1, never reused), safe for concurrent
// use.
type Store struct {
	mu     sync.Mutex
	next   int64
	models map[int64]*Model
}

// NewStore returns an empty store.
func NewStore() *Store { return &Store{next: 1, models: map[int64]*Model{}} }

// New stores a new model and returns its handle.
func (s *Store) New() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	h := s.next
	s.next++
	s.models[h] = New()
	return h
}

// With runs fn on model h under the store's lock.
func (s *Store) With(h int64, fn func(*Model) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.models[h]
	if !ok {
		return fmt.Errorf("no pool model %d (dropped, or never made)", h)
	}
	return fn(m)
}

// Drop forgets model h; it reports whether h was known.
func (s *Store) Drop(h int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.models[h]
	delete(s.models, h)
	return ok
}

// Live is how many models are held.
func (s *Store) Live() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.models)
}
