package gradslot

import (
	"fmt"
	"strings"
	"testing"
)

// d renders a decision as "PREPARE DELIVER [watch] LEARNED" in the table's
// letters, e.g. "z l u" (zero, lend, unknown) or "- c w u".
func d(x Decision) string {
	s := fmt.Sprintf("%c %c", prepareLetters[x.Prepare], deliverLetters[x.Deliver])
	if x.Watch {
		s += " w"
	}
	return s + fmt.Sprintf(" %c", learnedLetters[x.Learned])
}

// TestBackwardHandOut names what a backward graph's parameter grad becomes:
// added in by AccumulateGrad where .grad exists (the caller keeps its
// grads), else lent once the caller was seen dropping them, else an owned
// copy (watched while nothing is known).
func TestBackwardHandOut(t *testing.T) {
	tests := []struct {
		name    string
		src     Source
		st      State
		learned Learned
		want    string
	}{
		{"first backward of a lendable slot: an owned copy, watched", BackwardLendable, Empty, Unknown, "- c w u"},
		{"the caller drops its grads: the buffer is lent, watched", BackwardLendable, Empty, Dropped, "- l w d"},
		{"the caller keeps its grads: an owned copy, unwatched", BackwardLendable, Empty, Kept, "- c k"},
		{".grad exists: AccumulateGrad adds, the caller keeps its grads", BackwardLendable, Other, Dropped, "- a k"},
		{".grad is a captured buffer: added into all the same", BackwardLendable, Captured, Unknown, "- a k"},
		{"a slot that never lends: an owned copy", BackwardOwned, Empty, Unknown, "- c u"},
		{"a slot that never lends, .grad exists: added in", BackwardOwned, Other, Unknown, "- a k"},
		{"a .grad of another shape (torch refuses it): refused", BackwardOwned, Mismatch, Unknown, "- r u"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, held := range []bool{false, true} { // a backward buffer is gograph's: held plays no part
				if got := d(HandOut(tc.src, tc.st, held, tc.learned)); got != tc.want {
					t.Errorf("held %v: got %q, want %q", held, got, tc.want)
				}
			}
		})
	}
}

// TestWeightGradientHandOut names what each slot of a weight-gradient graph
// gets, for every state the caller may leave it in, as eager's
// backward_dw() would leave it.
func TestWeightGradientHandOut(t *testing.T) {
	tests := []struct {
		name string
		src  Source
		st   State
		held bool
		want string
	}{
		{"the tensor it captured: the replay adds into it, nothing more", WGradAdd, Captured, false, "- i u"},
		{"the captured tensor held elsewhere too: still only the replay", WGradAdd, Captured, true, "- i u"},
		{"None: the target is zeroed and lent back (eager's fresh gradient)", WGradAdd, Empty, false, "z l u"},
		{"None, the old tensor held elsewhere: saved around the replay, a copy handed out", WGradAdd, Empty, true, "s c u"},
		{"another tensor: the gradient alone is added into it", WGradAdd, Other, false, "z a u"},
		{"another tensor, the target held elsewhere: saved around the replay", WGradAdd, Other, true, "s a u"},
		{"another shape or device: refused (eager's add_ fails too)", WGradAdd, Mismatch, false, "- r u"},
		{"assigned at capture over a tensor: a copy, whatever the slot holds", WGradAssignTensor, Other, false, "- c u"},
		{"assigned over a tensor, slot None: a copy", WGradAssignTensor, Empty, false, "- c u"},
		{"assigned over a tensor, slot of another shape: replaced all the same", WGradAssignTensor, Mismatch, false, "- c u"},
		{"assigned to None at capture, None again: a copy", WGradAssignEmpty, Empty, false, "- c u"},
		{"assigned to None at capture, a tensor now: accumulated into it", WGradAssignEmpty, Other, true, "- a u"},
		{"assigned to None at capture, the slot holds the graph's own buffer: refused", WGradAssignEmpty, Captured, false, "- r u"},
		{"assigned to None at capture, another shape: refused", WGradAssignEmpty, Mismatch, false, "- r u"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for l := range numLearned { // weight-gradient slots learn nothing: what they knew stays
				want := tc.want[:len(tc.want)-1] + string(learnedLetters[l])
				if got := d(HandOut(tc.src, tc.st, tc.held, l)); got != want {
					t.Errorf("learned %c: got %q, want %q", learnedLetters[l], got, want)
				}
			}
		})
	}
}

// TestNoKeptTensorIsOverwritten checks the policy's promise on every row:
// a tensor the caller keeps is never zeroed or lent away. The graph's
// memory is prepared only where the slot no longer holds it, and saved
// where anything else holds it; a lent buffer goes only to an empty slot.
func TestNoKeptTensorIsOverwritten(t *testing.T) {
	for src := range numSources {
		for st := range numStates {
			for _, held := range []bool{false, true} {
				for l := range numLearned {
					x := HandOut(src, st, held, l)
					where := fmt.Sprintf("source %c state %c held %v learned %c: %s", sourceLetters[src], stateLetters[st], held, learnedLetters[l], d(x))
					if x.Prepare != Keep && st == Captured {
						t.Errorf("%s: prepares the memory the slot holds", where)
					}
					if x.Prepare == Zero && held {
						t.Errorf("%s: zeroes memory something else holds without saving it", where)
					}
					if x.Deliver == Lend && st != Empty {
						t.Errorf("%s: lends over a tensor the slot holds", where)
					}
					if x.Deliver == Lend && src == WGradAdd && held {
						t.Errorf("%s: lends a target something else holds", where)
					}
					if x.Deliver == Refuse && x.Prepare != Keep {
						t.Errorf("%s: prepares memory for a refused replay", where)
					}
					if src >= WGradAdd && x.Learned != l {
						t.Errorf("%s: a weight-gradient slot learned something", where)
					}
				}
			}
		}
	}
}

// TestSweep names what a slot learns at the first replay that may
// overwrite what a lendable backward handed out.
func TestSweep(t *testing.T) {
	tests := []struct {
		name          string
		lent, present bool
		learned       Learned
		copyOut       bool
		next          Learned
	}{
		{"a watched copy whose .grad is gone: the caller drops its grads", false, false, Unknown, false, Dropped},
		{"a watched copy still .grad: the caller keeps them", false, true, Unknown, false, Kept},
		{"kept once, kept for good", false, false, Kept, false, Kept},
		{"a lent buffer nobody holds: nothing to do", true, false, Dropped, false, Dropped},
		{"a lent buffer still held: copied out, the caller keeps its grads", true, true, Dropped, true, Kept},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out, next := Sweep(tc.lent, tc.present, tc.learned)
			if out != tc.copyOut || next != tc.next {
				t.Errorf("got (%v, %c), want (%v, %c)", out, learnedLetters[next], tc.copyOut, learnedLetters[tc.next])
			}
		})
	}
}

// TestCapture names what a weight-gradient capture's effect on a slot makes
// of it.
func TestCapture(t *testing.T) {
	tests := []struct {
		name   string
		before Before
		after  After
		want   string // the source letter, "-" for no target
	}{
		{"a tensor added into in place: the graph's target", WasTensor, Written, "a"},
		{"None, then a new tensor: the graph's own buffer, assigned to empty", WasEmpty, Replaced, "n"},
		{"a tensor replaced by a new one: the graph's own buffer, assigned over a tensor", WasTensor, Replaced, "t"},
		{"a tensor left alone: no target", WasTensor, Untouched, "-"},
		{"None left alone: no target", WasEmpty, Untouched, "-"},
		{"a tensor emptied: no target (the graph writes nothing it must receive)", WasTensor, Emptied, "-"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			src, ok := Capture(tc.before, tc.after)
			got := "-"
			if ok {
				got = string(sourceLetters[src])
			}
			if got != tc.want {
				t.Errorf("got %s, want %s", got, tc.want)
			}
		})
	}
}

// TestEncode checks the table's shape: every combination once, in the
// letters the package documents, and a few rows read back.
func TestEncode(t *testing.T) {
	text := Encode()
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	count := map[string]int{}
	seen := map[string]bool{}
	for _, line := range lines {
		f := strings.Fields(line)
		want := map[string]int{"handout": 9, "sweep": 6, "capture": 4}[f[0]]
		if len(f) != want {
			t.Fatalf("line %q has %d fields, want %d", line, len(f), want)
		}
		count[f[0]]++
		key := strings.Join(f[:map[string]int{"handout": 5, "sweep": 4, "capture": 3}[f[0]]], " ")
		if seen[key] {
			t.Errorf("%q appears twice", key)
		}
		seen[key] = true
	}
	wantCount := map[string]int{"handout": 5 * 4 * 2 * 3, "sweep": 2 * 2 * 3, "capture": 2 * 4}
	for k, n := range wantCount {
		if count[k] != n {
			t.Errorf("%d %s lines, want %d", count[k], k, n)
		}
	}
	for _, row := range []string{
		"handout a e 0 u z l 0 u",
		"handout a c 1 k - i 0 k",
		"handout l e 0 d - l 1 d",
		"sweep 1 1 d 1 k",
		"capture t w a",
		"capture e r n",
	} {
		if !strings.Contains(text, row+"\n") {
			t.Errorf("the table has no row %q", row)
		}
	}
}
