package gograph

import (
	"strings"
	"testing"

	"github.com/gograph/gograph/internal/wire"
)

// TestGradSlotPolicy: the policy crosses as a "gradslot v1" text whose body
// is the internal table, and reads back through the protocol's header check.
func TestGradSlotPolicy(t *testing.T) {
	text, err := GradSlotPolicy()
	if err != nil {
		t.Fatal(err)
	}
	_, body, err := wire.GradSlots.Body(text)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(text, "gradslot v1\n") || !strings.Contains(body, "handout a c 0 u - i 0 u\n") {
		t.Errorf("unexpected policy text:\n%s", text)
	}
}
