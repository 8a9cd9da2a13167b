/**
 * @file student.h
 * @brief Student mode (`make STUDENT=1 check-chNN`): the marker a stub calls until it is
 *        written.
 *
 * Each chapter's `student/` folder holds stubs of the functions the chapter asks you to
 * write, with the library's exact signatures. `make STUDENT=1 check-chNN` links them in
 * place of the library's versions (see the Makefile, "chapter self-checks") and runs the
 * chapter's tests on them. A stub starts with MOE_STUDENT_TODO(): delete that line when
 * you have written the function.
 */
#ifndef MOE_STUDENT_H
#define MOE_STUDENT_H

#include <stdio.h>
#include <stdlib.h>

/** Exit status of a stub that is not written yet (make test checks for it). */
#define MOE_STUDENT_TODO_STATUS 3

/** @brief Say which stub is not written yet, and stop. @param file the stub's source
 *  file @param fn the function */
static inline void moe_student_todo(const char *file, const char *fn) {
    fprintf(stderr, "TODO(student): %s: %s is not implemented yet -- see the TODOs in that file\n",
            file, fn);
    fflush(stderr);
    exit(MOE_STUDENT_TODO_STATUS);
}

/** Put this first in a stub; delete it when the function is written. */
#define MOE_STUDENT_TODO() moe_student_todo(__FILE__, __func__)

#endif /* MOE_STUDENT_H */
