// Package plans keeps the build plans Python holds by handle: a validated
// schedule (internal/schedule) stays in Go from make_graphed_callables'
// planning to the end of its build, so nothing round-trips through text;
// Python reads what it executes (the steps, the warmup and capture programs)
// and frees the handle when the build ends. The capture program, once
// planned, stays with its schedule: the memory prediction reads it, so a
// build plans its captures once.
package plans

import (
	"fmt"
	"sync"

	"github.com/gograph/gograph/internal/lifetime"
	"github.com/gograph/gograph/internal/schedule"
)

// Store holds plans by handle (from 1, never reused). It is safe for
// concurrent use: builds on several threads each hold their own handles.
type Store struct {
	mu    sync.Mutex
	next  int64
	plans map[int64]*entry
}

type entry struct {
	plan    *schedule.Plan
	program *lifetime.Program // nil until the captures are planned
}

// NewStore returns an empty store.
func NewStore() *Store {
	return &Store{next: 1, plans: make(map[int64]*entry)}
}

// Put stores p and returns its handle.
func (s *Store) Put(p *schedule.Plan) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	h := s.next
	s.next++
	s.plans[h] = &entry{plan: p}
	return h
}

// Get returns the plan of handle h.
func (s *Store) Get(h int64) (*schedule.Plan, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.plans[h]
	if e == nil {
		return nil, unknown(h)
	}
	return e.plan, nil
}

func unknown(h int64) error {
	return fmt.Errorf("unknown plan handle %d (never planned or already freed)", h)
}

// SetProgram keeps prog as the capture program of handle h (replacing an
// earlier one: the latest planning is the build's).
func (s *Store) SetProgram(h int64, prog *lifetime.Program) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.plans[h]
	if e == nil {
		return unknown(h)
	}
	e.program = prog
	return nil
}

// Program returns the capture program of handle h, planned earlier.
func (s *Store) Program(h int64) (*schedule.Plan, *lifetime.Program, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.plans[h]
	if e == nil {
		return nil, nil, unknown(h)
	}
	if e.program == nil {
		return nil, nil, fmt.Errorf("plan handle %d has no capture program yet (plan the captures first)", h)
	}
	return e.plan, e.program, nil
}

// Free forgets handle h and reports whether it was known; freeing twice is
// harmless (a build's cleanup may run after an explicit free).
func (s *Store) Free(h int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.plans[h]
	delete(s.plans, h)
	return ok
}

// Live returns how many plans are held (leak checks).
func (s *Store) Live() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.plans)
}
