//go:build !cuda

package gograph

import (
	"strings"
	"testing"
)

// guardedPair builds passes A and B (eager graphs) captured in the order
// fwd A, fwd B, bwd B, bwd A in pool, with the guard on.
func guardedPair(t *testing.T, pool string) (a, b int64) {
	t.Helper()
	a, _ = NewPass(0, "A")
	b, _ = NewPass(1, "B")
	for i, c := range []struct {
		p    int64
		kind int
	}{{a, 0}, {b, 0}, {b, 1}, {a, 1}} {
		if _, err := BeginPassCapture(c.p, c.kind, pool, 0, 0); err != nil {
			t.Fatal(err)
		}
		if seq, err := EndPassCapture(c.p, c.kind, 0); seq != i+1 || err != nil {
			t.Fatalf("EndPassCapture = %d, %v; want %d", seq, err, i+1)
		}
	}
	for _, p := range []int64{a, b} {
		if on, err := SetReplayOrderCheck(p, true); !on || err != nil {
			t.Fatalf("SetReplayOrderCheck = %v, %v", on, err)
		}
		if _, err := SealPass(p); err != nil {
			t.Fatal(err)
		}
	}
	return a, b
}

func TestReplayOrderGuardSurface(t *testing.T) {
	a, b := guardedPair(t, "eager/1")
	defer DropPass(a)
	defer DropPass(b)
	if seq, err := CaptureSeq(b, 1); seq != 3 || err != nil {
		t.Fatalf("CaptureSeq = %d, %v", seq, err)
	}
	if pool, err := PassPool(a); pool != "eager/1" || err != nil {
		t.Fatalf("PassPool = %q, %v", pool, err)
	}
	if on, err := ReplayOrderCheck(a); !on || err != nil {
		t.Fatalf("ReplayOrderCheck = %v, %v", on, err)
	}
	for _, r := range [][2]int64{{a, 0}, {b, 0}, {b, 1}, {a, 1}, {a, 0}, {b, 0}, {b, 1}, {a, 1}} {
		if _, err := Replay(r[0], int(r[1]), 0); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Replay(a, 0, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := Replay(b, 0, 0); err != nil {
		t.Fatal(err)
	}
	if s, err := ReplayOrderState("eager/1"); !strings.Contains(s, `("A", pass`) || !strings.Contains(s, `("B", pass`) || err != nil {
		t.Fatalf("ReplayOrderState = %q, %v", s, err)
	}
	_, err := Replay(a, 1, 0) // B's backward must run first
	if err == nil || !strings.Contains(err.Error(), `refusing to replay the backward of graphed callable 0 ("A"`) ||
		!strings.Contains(err.Error(), `graphed callable 1 ("B"`) {
		t.Fatalf("out-of-order Replay: %v", err)
	}
	if open, err := DiscardReplayOrder(b); !open || err != nil {
		t.Fatalf("DiscardReplayOrder = %v, %v", open, err)
	}
	if _, err := Replay(a, 1, 0); err != nil {
		t.Fatalf("after discarding B: %v", err)
	}
	if s, _ := ReplayOrderState("eager/1"); s != "" {
		t.Fatalf("open passes left: %q", s)
	}
	if on, err := SetReplayOrderCheck(a, false); on || err != nil {
		t.Fatalf("SetReplayOrderCheck(false) = %v, %v", on, err)
	}
}

func TestReplayOrderGuardErrors(t *testing.T) {
	p, _ := NewPass(0, "fc")
	defer DropPass(p)
	if _, err := SetReplayOrderCheck(p, true); err == nil || !strings.Contains(err.Error(), "no recorded capture") {
		t.Fatalf("SetReplayOrderCheck without captures: %v", err)
	}
	if _, err := CaptureSeq(p, 7); err == nil || !strings.Contains(err.Error(), "unknown graph kind 7") {
		t.Fatalf("CaptureSeq(kind 7): %v", err)
	}
	if _, err := CaptureSeq(-3, 0); err == nil || err.Error() != "unknown pass -3" {
		t.Fatalf("CaptureSeq(-3): %v", err)
	}
	if _, err := DiscardReplayOrder(-3); err == nil {
		t.Fatal("DiscardReplayOrder(-3) succeeded")
	}
	if _, err := ReplayOrderCheck(-3); err == nil {
		t.Fatal("ReplayOrderCheck(-3) succeeded")
	}
	if s, err := ReplayOrderState("no such pool"); s != "" || err != nil {
		t.Fatalf("ReplayOrderState = %q, %v", s, err)
	}
}

func TestCheckReplayOrder(t *testing.T) {
	a, b := guardedPair(t, "eager/check")
	defer DropPass(a)
	defer DropPass(b)
	for _, r := range [][2]int64{{a, 0}, {b, 0}} {
		if _, err := Replay(r[0], int(r[1]), 0); err != nil {
			t.Fatal(err)
		}
	}
	if ok, err := CheckReplayOrder(b, 1); !ok || err != nil {
		t.Fatalf("CheckReplayOrder(b, backward) = %v, %v", ok, err)
	}
	if ok, err := CheckReplayOrder(a, 1); ok || err == nil || !strings.Contains(err.Error(), "refusing to replay the backward") {
		t.Fatalf("CheckReplayOrder(a, backward) = %v, %v", ok, err)
	}
	for _, r := range [][2]int64{{b, 1}, {a, 1}} {
		if _, err := Replay(r[0], int(r[1]), 0); err != nil {
			t.Fatal(err)
		}
	}
}
