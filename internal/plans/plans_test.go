package plans

import (
	"strings"
	"sync"
	"testing"

	"github.com/gograph/gograph/internal/lifetime"
	"github.com/gograph/gograph/internal/schedule"
)

func TestStore(t *testing.T) {
	s := NewStore()
	p, _ := schedule.Default(2, true)
	a, b := s.Put(p), s.Put(p)
	if a != 1 || b != 2 || s.Live() != 2 {
		t.Fatalf("handles %d, %d, live %d", a, b, s.Live())
	}
	if got, err := s.Get(a); got != p || err != nil {
		t.Fatalf("Get = %v, %v", got, err)
	}
	if !s.Free(a) || s.Free(a) {
		t.Fatal("Free twice should report true then false")
	}
	for _, h := range []int64{a, 0, -1, 99} {
		if _, err := s.Get(h); err == nil || !strings.Contains(err.Error(), "unknown plan handle") {
			t.Errorf("Get(%d): %v", h, err)
		}
	}
	if c := s.Put(p); c != 3 {
		t.Fatalf("handle %d reused; want 3", c)
	}
}

func TestStoreConcurrent(t *testing.T) {
	s := NewStore()
	p, _ := schedule.Default(1, false)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				h := s.Put(p)
				if _, err := s.Get(h); err != nil {
					t.Error(err)
				}
				s.Free(h)
			}
		}()
	}
	wg.Wait()
	if s.Live() != 0 {
		t.Fatalf("Live = %d", s.Live())
	}
}

func TestStoreProgram(t *testing.T) {
	s := NewStore()
	p, _ := schedule.Default(1, true)
	h := s.Put(p)
	if _, _, err := s.Program(h); err == nil || !strings.Contains(err.Error(), "no capture program yet") {
		t.Fatalf("Program before planning: %v", err)
	}
	prog := &lifetime.Program{}
	if err := s.SetProgram(h, prog); err != nil {
		t.Fatal(err)
	}
	if gp, got, err := s.Program(h); gp != p || got != prog || err != nil {
		t.Fatalf("Program = %v, %v, %v", gp, got, err)
	}
	s.Free(h)
	if err := s.SetProgram(h, prog); err == nil || !strings.Contains(err.Error(), "unknown plan handle") {
		t.Errorf("SetProgram after Free: %v", err)
	}
	if _, _, err := s.Program(h); err == nil {
		t.Error("Program after Free")
	}
}
